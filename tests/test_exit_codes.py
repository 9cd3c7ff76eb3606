"""`batchgen run`'s exit-code table, each code produced by the failure it stands for.

0 ok, 1 row errors with --strict, 2 bad job/model/input or permission, 70 internal error
(one line + crash report), 74 I/O error (disk full), 75 stopped (requeue), 130 second SIGINT.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "pipeline"))

from fake_engine import FakeEngine, FakeTokenizer  # noqa: E402
from workspace import make_job, read_output, rows, write_jsonl  # noqa: E402

from batchgen import cli  # noqa: E402
from batchgen.engine.request_checks import ModelLimits  # noqa: E402
from batchgen.io import writer  # noqa: E402
from batchgen.pipeline import engine_factory  # noqa: E402

# polars writes and reads the Parquet these tests check; without it (the GPU machine runs only
# `pytest -m gpu`) this module is skipped at collection.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")

REAL_BUILD_ENGINE = engine_factory.build_engine
REAL = {
    "model_limits": engine_factory.model_limits,
    "build_tokenizer": engine_factory.build_tokenizer,
}


@pytest.fixture(autouse=True)
def fake_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.setattr(engine_factory, "build_engine", lambda job: FakeEngine(max_model_len=200))
    monkeypatch.setattr(engine_factory, "build_tokenizer", lambda job: FakeTokenizer())
    monkeypatch.setattr(engine_factory, "model_limits", lambda job: ModelLimits(200, 259))


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def job_of(tmp_path, n=30, **sections) -> str:
    write_jsonl(tmp_path / "in.jsonl", rows(n))
    sections.setdefault("output", {"shard_rows": 10})
    return str(make_job(tmp_path, "in.jsonl", **sections))


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_0_ok_and_1_row_errors_with_strict(tmp_path):
    job = job_of(tmp_path)
    assert invoke("run", job).exit_code == 0
    (tmp_path / "in.jsonl").write_text((tmp_path / "in.jsonl").read_text() + "{not json\n")
    res = invoke("run", job, "--overwrite")
    assert res.exit_code == 0 and "1 row(s) ended as error records" in res.output
    assert invoke("run", job, "--strict").exit_code == 1


def test_2_bad_job(tmp_path):
    res = invoke("run", job_of(tmp_path), "--set", "sampling.temprature=1")
    assert res.exit_code == 2 and "sampling.temprature" in res.output


def real_model(tiny_model_dir, tmp_path, monkeypatch) -> Path:
    """The job's model dir becomes a copy of the tiny llama, read by the real checks."""
    for name, fn in REAL.items():
        monkeypatch.setattr(engine_factory, name, fn)
    model = tmp_path / "model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(tiny_model_dir("llama"), model)
    return model


def edit_json(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    "file, change, message",
    [
        ("tokenizer_config.json", lambda c: [c], r"tokenizer_config.json: must be a JSON object"),
        ("config.json", lambda c: {**c, "num_attention_heads": 0}, r"num_attention_heads=0"),
        ("config.json", lambda c: {**c, "vocab_size": "lots"}, r"vocab_size='lots'"),
        ("config.json", lambda c: {**c, "vocab_size": 10**12}, r"vocab_size=1000000000000"),
        ("config.json", lambda c: {**c, "hidden_size": 128}, r"embed_tokens.weight' has shape"),
    ],
    ids=["list-tokenizer-config", "zero-heads", "vocab-lots", "vocab-1e12", "larger-than-weights"],
)
@pytest.mark.parametrize("command", ["run", "validate"])
def test_2_bad_model_is_one_clear_line_before_anything_loads(
    tiny_model_dir, tmp_path, monkeypatch, command, file, change, message
):
    job = job_of(tmp_path)
    model = real_model(tiny_model_dir, tmp_path, monkeypatch)
    edit_json(model / file, change)
    monkeypatch.setattr(engine_factory, "build_engine", lambda job: pytest.fail("model loaded"))
    res = invoke(command, job)
    assert res.exit_code == 2, res.output
    (line,) = error_lines(res.output)
    assert "Traceback" not in res.output
    assert line.startswith("error: model.path: ") and os.path.join("model", file) in line
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


def _write_table_to(target: str):
    """pyarrow's write_table (the writer's), redirected to `target` for shard 2 (/dev/full: a
    real ENOSPC from pyarrow)."""
    real = writer.pq.write_table

    def write(table, where, **kw):
        if "part-00002" in str(where):
            return real(table, target, **kw)
        return real(table, where, **kw)

    return write


def test_74_disk_full_names_the_shard_and_keeps_committed_shards(tmp_path, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full to produce a real ENOSPC")
    job = job_of(tmp_path, n=40)
    monkeypatch.setattr(writer.pq, "write_table", _write_table_to("/dev/full"))
    res = invoke("run", job)
    assert res.exit_code == 74, res.output
    (line,) = error_lines(res.output)
    shard = os.path.join("out", "part-00002.parquet")
    assert line.startswith(f"error: no space left writing {shard} (No space left on device)")
    assert "Traceback" not in res.output
    kept = sorted(p.name for p in (tmp_path / "out").glob("part-*"))
    assert "part-00002.parquet" not in kept and len(kept) >= 2
    assert not [p for p in os.listdir(tmp_path / "out") if ".tmp-" in p]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    fake_engine_again(monkeypatch, tmp_path)
    res = invoke("run", job)
    assert res.exit_code == 0 and "_SUCCESS written" in res.output
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in rows(40)]


def fake_engine_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_factory, "build_engine", lambda job: FakeEngine(max_model_len=200))
    monkeypatch.setattr(engine_factory, "build_tokenizer", lambda job: FakeTokenizer())
    monkeypatch.setattr(engine_factory, "model_limits", lambda job: ModelLimits(200, 259))


def test_2_permission_denied_names_the_path(tmp_path, monkeypatch):
    job = job_of(tmp_path)

    def denied(table, where, **kw):
        raise PermissionError(13, "Permission denied", str(where))

    monkeypatch.setattr(writer.pq, "write_table", denied)
    res = invoke("run", job)
    assert res.exit_code == 2, res.output
    (line,) = error_lines(res.output)
    assert line.startswith("error: permission denied: out/.part-00000.parquet.tmp-")


def test_70_crash_while_writing_is_one_line_and_a_crash_report(tmp_path, monkeypatch):
    job = job_of(tmp_path, n=40)
    real = writer.to_frame

    def crash_on_shard_2(rows_, layout):
        if rows_ and rows_[0].index == 20:
            raise ValueError("boom: a bug while writing")
        return real(rows_, layout)

    monkeypatch.setattr(writer, "to_frame", crash_on_shard_2)
    res = invoke("run", job)
    assert res.exit_code == 70, res.output
    assert "Traceback" not in res.output
    (line,) = error_lines(res.output)
    assert line.startswith("error: internal error (ValueError: boom: a bug while writing)")
    report = line.split("the full traceback is in ")[1].split(". Committed")[0]
    assert report.startswith(str(tmp_path / "cache" / "crash-reports"))
    text = Path(report).read_text()
    assert "Traceback (most recent call last)" in text and "crash_on_shard_2" in text
    assert "ValueError: boom: a bug while writing" in text
    monkeypatch.setattr(writer, "to_frame", real)
    res = invoke("run", job)
    assert res.exit_code == 0 and "_SUCCESS written" in res.output
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in rows(40)]


class _SignalingEngine(FakeEngine):
    """Sends itself `signals` once, at its second step."""

    def __init__(self, signals):
        super().__init__(max_model_len=200, max_num_seqs=2)
        self.pending = list(signals)

    def step(self):
        if self.stats.num_steps == 1:
            while self.pending:
                os.kill(os.getpid(), self.pending.pop(0))
        return super().step()


def test_75_stopped_and_130_second_sigint(tmp_path, monkeypatch):
    job = job_of(tmp_path, n=200)  # more shards than the engine takes in at once
    monkeypatch.setattr(
        engine_factory, "build_engine", lambda j: _SignalingEngine([signal.SIGTERM])
    )
    res = invoke("run", job)
    assert res.exit_code == 75 and "interrupted by SIGTERM" in res.output
    monkeypatch.setattr(
        engine_factory, "build_engine", lambda j: _SignalingEngine([signal.SIGINT] * 2)
    )
    res = invoke("run", job)
    assert res.exit_code == 130, res.output
    (line,) = error_lines(res.output)
    assert line == "error: interrupted twice: stopped at once; committed shards are kept"


def test_2_model_without_weights_validates_but_does_not_run(tiny_model_dir, tmp_path, monkeypatch):
    # Config and tokenizer alone (copied to validate a job elsewhere): validate reads no
    # weights and passes; run fails as the model loads, before anything is allocated.
    job = job_of(tmp_path)
    model = real_model(tiny_model_dir, tmp_path, monkeypatch)
    (model / "model.safetensors").unlink()
    assert invoke("validate", job).exit_code == 0
    monkeypatch.setattr(engine_factory, "build_engine", REAL_BUILD_ENGINE)
    res = invoke("run", job, "--set", "model.device=cpu")
    assert res.exit_code == 2, res.output
    (line,) = error_lines(res.output)
    assert line.startswith("error: model: ") and "no weights found" in line
