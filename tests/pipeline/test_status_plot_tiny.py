"""On the tiny model: the progress bar counts to the job's rows, and `status --plot` draws the
run (a valid PNG of the set size)."""

from __future__ import annotations

import contextlib
import io
import re
import struct

import pytest
import yaml
from click.testing import CliRunner
from workspace import TEMPLATE, rows, write_jsonl

from batchgen import cli
from batchgen.job import load_job
from batchgen.pipeline.runner import Runner

ROWS, SHARD_ROWS = 60, 15  # 4 shards


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    """The tiny job run once with the bar on: (output directory, what the bar wrote)."""
    root = tmp_path_factory.mktemp("tiny-run")
    write_jsonl(root / "in.jsonl", rows(ROWS))
    job = {
        "model": {
            "path": tiny_model_dir("llama"),
            "max_num_seqs": 16,
            "num_kv_blocks": 256,
            "max_model_len": 256,
            "dtype": "float32",
        },
        "input": {"path": str(root / "in.jsonl"), "columns": ["topic"]},
        "prompt": {"template": TEMPLATE},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "output": {"path": str(root / "out"), "shard_rows": SHARD_ROWS},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        result = Runner(load_job(str(root / "job.yaml")), progress=True).run()
    assert result.complete, err.getvalue()[-2000:]
    return root / "out", err.getvalue()


def test_bar_total_is_the_jobs_rows(tiny_run):
    _, bar = tiny_run
    assert f"0/{ROWS} [" in bar  # the total is known from the start
    assert re.search(rf"\| {ROWS}/{ROWS} \[\d\d:\d\d<\d\d:\d\d, [\d.]+row/s, [\d.]+ gen tok/s", bar)


def test_status_plot_writes_a_png(tiny_run, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    out, _ = tiny_run
    png = tmp_path / "run.png"
    res = CliRunner().invoke(cli.main, ["status", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert f"shards: {ROWS // SHARD_ROWS}/{ROWS // SHARD_ROWS} committed" in res.output
    assert f"plot: wrote {png} ({ROWS // SHARD_ROWS} commit(s) from 1 run(s))" in res.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # The first chunk is IHDR: width and height (big-endian), 10 x 6 inches at 100 dpi.
    assert data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1000, 600)
    from PIL import Image  # matplotlib's own dependency: decode the whole image

    with Image.open(png) as img:
        img.load()
        assert img.size == (1000, 600)
        assert len(img.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 2  # not a blank image
