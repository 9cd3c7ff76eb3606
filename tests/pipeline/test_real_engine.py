"""`batchgen run` end to end on the tiny model: exact ids, texts equal LLM.generate, kill-safe."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from workspace import TEMPLATE, read_output, rows, write_jsonl, write_parquet

from batchgen import LLM, SamplingParams
from batchgen.job import load_job
from batchgen.pipeline.runner import Runner

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"max_num_seqs": 32, "num_kv_blocks": 512, "max_model_len": 256, "dtype": "float32"}


def real_job(root: Path, model: str, input_path: str, shard_rows: int = 100, **engine) -> Path:
    job = {
        "model": {"path": model, **ENGINE, **engine},
        "input": {"path": input_path, "columns": ["topic"]},
        "prompt": {"template": TEMPLATE},
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": shard_rows},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_500_rows_ids_exact_and_texts_equal_llm_generate(
    tmp_path, monkeypatch, tiny_model_dir, fmt
):
    model = tiny_model_dir("llama")
    data = rows(500)
    write = write_jsonl if fmt == "jsonl" else write_parquet
    write(tmp_path / f"in.{fmt}", data)
    monkeypatch.chdir(tmp_path)
    result = Runner(load_job(str(real_job(tmp_path, model, f"in.{fmt}")))).run()
    assert result.exit_code == 0
    df = read_output(tmp_path / "out")
    assert df["id"].to_list() == [r["id"] for r in data]
    assert df["error"].null_count() == len(data)
    llm = LLM(model, **ENGINE)
    prompts = [TEMPLATE.format(text=r["text"]) for r in data]
    expected = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert df["text"].to_list() == [o.text for o in expected]
    assert df["num_output_tokens"].to_list() == [len(o.token_ids) for o in expected]
    assert df["num_prompt_tokens"].to_list() == [o.num_prompt_tokens for o in expected]


@pytest.mark.slow
def test_cli_sigkill_at_random_moments_then_resume(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = rows(400)
    write_jsonl(tmp_path / "ref" / "in.jsonl", data)
    write_jsonl(tmp_path / "work" / "in.jsonl", data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "batchgen", "run", "job.yaml", "--no-progress"]

    def run(cwd: Path) -> subprocess.Popen:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    for name in ("ref", "work"):
        # Few sequences at a time, so shards commit one by one and kills land mid-run.
        real_job(tmp_path / name, model, "in.jsonl", shard_rows=10, max_num_seqs=4)
    ref = run(tmp_path / "ref")
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()
    committed = tmp_path / "work" / "out" / "_manifest"

    def num_committed() -> int:
        return len(list(committed.glob("*.json"))) if committed.exists() else 0

    rng = random.Random(11)
    kills = 0
    for _ in range(10):
        # Kill at a random moment once this run has committed 1-2 more shards: mid-shard,
        # mid-commit or mid-manifest-write, whatever the moment happens to be.
        proc = run(tmp_path / "work")
        target = num_committed() + rng.choice([1, 2])
        while proc.poll() is None and num_committed() < target:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=300)
    assert kills >= 8
    final = run(tmp_path / "work")
    assert final.wait(timeout=300) == 0, final.stderr.read().decode()
    out = tmp_path / "work" / "out"
    assert (out / "_SUCCESS").exists()
    for f in out.glob("part-*.parquet"):
        pq.read_metadata(f)  # every file readable
    got, want = read_output(out), read_output(tmp_path / "ref" / "out")
    assert got["id"].to_list() == [r["id"] for r in data]  # every id once, in order
    assert got["text"].to_list() == want["text"].to_list()
