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


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Wait for a run, reading its stderr (a full pipe would stall it): exit code, stderr. The
    timeout only catches a hang; a loaded 2-core machine stays far below it."""
    stderr = proc.communicate(timeout=600)[1]
    return proc.returncode, stderr.decode(errors="replace")


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
    rc, stderr = finish(run(tmp_path / "ref"))
    assert rc == 0, stderr
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
        finish(proc)
    assert kills >= 8
    rc, stderr = finish(run(tmp_path / "work"))
    assert rc == 0, stderr
    out = tmp_path / "work" / "out"
    assert (out / "_SUCCESS").exists()
    for f in out.glob("part-*.parquet"):
        pq.read_metadata(f)  # every file readable
    got, want = read_output(out), read_output(tmp_path / "ref" / "out")
    assert got["id"].to_list() == [r["id"] for r in data]  # every id once, in order
    assert got["text"].to_list() == want["text"].to_list()


def _validate_then_run(job_path: Path):
    from collections import Counter

    from batchgen.pipeline.validate import validate

    job = load_job(str(job_path))
    report = validate(job)  # the real tokenizer and config.json; no weights
    result = Runner(job).run()
    assert result.exit_code == 0
    df = read_output(job.output.path)
    errors = df.filter(df["error_code"].is_not_null())
    # Every row the run failed, validate failed with the same code and message, and no other.
    assert report.ok == df.height - errors.height
    assert dict(report.errors) == dict(Counter(errors["error_code"].to_list()))
    assert sorted(report.examples) == sorted(
        f"[{c}] {m}" for c, m in zip(errors["error_code"], errors["error"])
    )
    return dict(zip(df["id"].to_list(), df["error_code"].to_list()))


def test_validate_predicts_the_runs_engine_errors(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = rows(7)
    data[1]["params"] = {"max_tokens": 240}  # prompt + 240 > max_model_len 256
    data[2]["params"] = {"max_tokens": 10_000_000}
    data[3]["params"] = {"stop_token_ids": [600]}  # the tiny vocabulary has 512 ids
    data[4]["params"] = {"n": 100_000}
    data[5]["params"] = {"logprobs": 5, "stop_token_ids": [7]}  # fine
    write_jsonl(tmp_path / "in.jsonl", data)
    monkeypatch.chdir(tmp_path)
    path = real_job(tmp_path, model, "in.jsonl")
    job = yaml.safe_load(path.read_text())
    job["sampling"]["overrides_column"] = "params"
    path.write_text(yaml.safe_dump(job))
    codes = _validate_then_run(path)
    bad = ["prompt_too_long", "bad_params", "bad_params", "bad_params"]
    assert list(codes.values()) == [None, *bad, None, None]


def test_validate_predicts_invalid_token_ids(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    lines = [
        {"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 4}}
        for i, p in enumerate([[0, 5, 9], [0, 5, 600], [0, True], [0, -1], "Once upon"])
    ]
    write_jsonl(tmp_path / "batch.jsonl", [{"method": "POST", **x} for x in lines])
    monkeypatch.chdir(tmp_path)
    path = real_job(tmp_path, model, "batch.jsonl")
    job = yaml.safe_load(path.read_text())
    del job["prompt"]
    job["input"]["columns"] = []
    path.write_text(yaml.safe_dump(job))
    codes = _validate_then_run(path)
    assert list(codes.values()) == [None] + ["invalid_token_id"] * 3 + [None]


def test_validate_checks_ids_against_config_vocab_size(tmp_path, monkeypatch, tiny_model_dir):
    # A tokenizer whose ids run past config.json's vocab_size: found without any weights.
    import json
    import shutil

    from batchgen.pipeline.validate import validate

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(tiny_model_dir("llama"), name)):
            shutil.copy(os.path.join(tiny_model_dir("llama"), name), model / name)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 100
    (model / "config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    monkeypatch.chdir(tmp_path)
    report = validate(load_job(str(real_job(tmp_path, str(model), "in.jsonl"))))
    assert (report.ok, dict(report.errors)) == (0, {"invalid_token_id": 3})
    assert "prompt has token id(s) outside [0, 100): " in report.examples[0]
