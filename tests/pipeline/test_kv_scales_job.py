"""A job with an FP8 KV cache and calibrate_kv_scales: the scales come from the first input rows,
are kept in `_kv_scales.json`, reused by every task and resume, and belong to the fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from workspace import TEMPLATE, read_output, rows, write_jsonl

from batchgen import LLM, SamplingParams
from batchgen.job import JobError, load_job
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.sharding import ShardSelector

ENGINE = {
    "max_num_seqs": 16,
    "num_kv_blocks": 256,
    "max_model_len": 128,
    "dtype": "float32",
    "kv_cache_dtype": "fp8",
    "calibrate_kv_scales": 8,
}


def job_file(root: Path, model: str, **engine) -> Path:
    job = {
        "model": {"path": model, **{**ENGINE, **engine}},
        "input": {"path": "in.jsonl"},
        "prompt": {"template": TEMPLATE},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": 10},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(path: Path, shard: str = "0/1", overwrite: bool = False) -> tuple[Runner, list[str]]:
    logs: list[str] = []
    runner = Runner(
        load_job(str(path)), ShardSelector.parse(shard), overwrite=overwrite, log=logs.append
    )
    assert runner.run().exit_code == 0
    return runner, logs


@pytest.fixture
def workspace(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    data = rows(30)
    write_jsonl(tmp_path / "in.jsonl", data)
    monkeypatch.chdir(tmp_path)
    return tmp_path, model, data


def test_scales_from_first_rows_stored_and_outputs_equal_llm(workspace):
    root, model, data = workspace
    runner, logs = run(job_file(root, model))
    record = json.loads((root / "out" / "_kv_scales.json").read_text())
    assert record["fingerprint"] == runner.fingerprint and record["num_prompts"] == 8
    assert any("calibrating FP8 K/V scales on the first 8 prompt(s)" in m for m in logs)
    # The same scales as LLM.calibrate_kv_scales on the first 8 rows' prompts, in input order.
    llm = LLM(model, **{k: v for k, v in ENGINE.items() if k != "calibrate_kv_scales"})
    prompts = [TEMPLATE.format(text=r["text"]) for r in data]
    expected_scales = llm.calibrate_kv_scales(prompts[:8])
    assert record["scales"] == [list(pair) for pair in expected_scales]
    assert all(s != 1.0 for pair in expected_scales for s in pair)
    expected = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert read_output(root / "out")["text"].to_list() == [o.text for o in expected]


def test_tasks_and_resume_reuse_the_stored_scales(workspace):
    root, model, _ = workspace
    path = job_file(root, model)
    _, logs = run(path, "0/2")
    stored = (root / "out" / "_kv_scales.json").read_text()
    _, logs = run(path, "1/2")
    assert not any("calibrating" in m for m in logs)  # the other task read the file
    single = read_output(root / "out")["text"].to_list()
    (root / "out" / "part-00001.parquet").unlink()  # a resume redoes that shard
    _, logs = run(path)
    assert not any("calibrating" in m for m in logs)
    assert (root / "out" / "_kv_scales.json").read_text() == stored
    assert read_output(root / "out")["text"].to_list() == single


def test_numeric_options_are_in_the_fingerprint(workspace):
    root, model, _ = workspace
    run(job_file(root, model))
    with pytest.raises(JobError, match=r"changed: model"):
        run(job_file(root, model, calibrate_kv_scales=4))
    _, logs = run(job_file(root, model, calibrate_kv_scales=4), overwrite=True)
    assert json.loads((root / "out" / "_kv_scales.json").read_text())["num_prompts"] == 4
    assert any("calibrating" in m for m in logs)  # --overwrite removed the old scales
    with pytest.raises(JobError, match=r"changed: model"):
        run(job_file(root, model, kv_cache_dtype="auto", calibrate_kv_scales=0))


def test_bad_kv_options_fail_before_the_model_loads(workspace):
    root, model, _ = workspace
    with pytest.raises(JobError, match=r"model\.kv_cache_dtype='int8': expected auto or fp8"):
        load_job(str(job_file(root, model, kv_cache_dtype="int8")))
    with pytest.raises(JobError, match=r"calibrate_kv_scales=8: needs kv_cache_dtype fp8"):
        load_job(str(job_file(root, model, kv_cache_dtype="auto")))


def test_quantization_is_a_numeric_option_of_the_fingerprint(workspace):
    from batchgen.pipeline.fingerprint import fingerprint_parts

    root, model, _ = workspace
    base = dict(kv_cache_dtype="auto", calibrate_kv_scales=0)
    plain = fingerprint_parts(load_job(str(job_file(root, model, **base))), [])
    fp8 = fingerprint_parts(load_job(str(job_file(root, model, **base, quantization="fp8"))), [])
    assert plain["model"] != fp8["model"] and plain["prompt"] == fp8["prompt"]
    faster = fingerprint_parts(load_job(str(job_file(root, model, **base, max_num_seqs=4))), [])
    assert faster == plain  # speed-only options stay out
