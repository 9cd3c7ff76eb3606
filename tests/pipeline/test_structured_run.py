"""`batchgen run` / `validate` with structured output on the tiny model: a job-level schema file,
per-row constraints through the overrides column, the incomplete and json columns, refused
constraints as job errors (before the model loads) or row error records, and a resumed run
regenerating a lost shard with the same outputs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from workspace import rows, write_jsonl

from batchgen.io import manifest
from batchgen.job import JobError, load_job
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.validate import validate

pl = pytest.importorskip("polars")  # a module skipped, not an error, where polars is missing

SCHEMA = {
    "type": "object",
    "properties": {
        "value": {"type": "number", "minimum": -10, "maximum": 10},
        "unit": {"enum": ["C", "F", "K"]},
        "ok": {"type": "boolean"},
    },
    "required": ["value", "unit", "ok"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,5}"


def _overrides(i: int) -> str | None:
    if 40 <= i < 45:
        return json.dumps({"structured_outputs": {"regex": REGEX}})
    if i == 45:  # a keyword the grammar engine cannot enforce
        return json.dumps({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}})
    if i == 46:  # not a schema at all
        return json.dumps({"structured_outputs": {"json": "{not json"}})
    if i == 47:  # too short for the schema: cut, incomplete
        return json.dumps({"max_tokens": 6})
    return None


def _workspace(root: Path, model: str, schema: dict | None = None) -> Path:
    data = rows(48)
    for i, r in enumerate(data):
        r["params"] = _overrides(i)
    write_jsonl(root / "in.jsonl", data)
    (root / "schema.json").write_text(json.dumps(schema or SCHEMA))
    job = {
        "model": {"path": model, "max_num_seqs": 16, "max_model_len": 256, "dtype": "float32"},
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "Reading for {text}:"},
        "sampling": {
            "max_tokens": 96,
            "temperature": 1.0,
            "seed": 3,
            "structured_outputs": {"json": "schema.json"},
            "overrides_column": "params",
        },
        "output": {"path": "out", "shard_rows": 16, "parse_json": True},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root / "job.yaml"


def _read(out: Path) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in sorted(out.glob("part-*.parquet"))])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The CPU decode path loops over sequences: on a shared machine, two threads fight over
    # two cores and run many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """The job run once: (workspace, its output)."""
    root = tmp_path_factory.mktemp("structured-run")
    job_path = _workspace(root, tiny_model_dir("llama"))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        result = Runner(load_job(str(job_path))).run()
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0
    return root, _read(root / "out")


def test_outputs_follow_their_constraints(run):
    _, df = run
    assert {"incomplete", "json"} <= set(df.columns)
    by_id = {r["id"]: r for r in df.iter_rows(named=True)}
    validator = jsonschema.Draft202012Validator(SCHEMA)
    stops = 0
    for i in range(40):
        r = by_id[f"r{i:05d}"]
        if r["finish_reason"] == "stop":
            stops += 1
            validator.validate(json.loads(r["text"]))
            assert r["incomplete"] is False
            assert r["json"] == json.dumps(json.loads(r["text"]), separators=(",", ":"))
        else:
            assert r["incomplete"] is True and r["json"] is None
    assert stops >= 32
    for i in range(40, 45):
        r = by_id[f"r{i:05d}"]
        assert re.fullmatch(REGEX, r["text"]) and r["incomplete"] is False
        assert r["json"] is None  # not JSON text
    cut = by_id["r00047"]
    assert cut["finish_reason"] == "length" and cut["incomplete"] is True and cut["json"] is None


def test_refused_row_constraints_are_error_records(run):
    _, df = run
    by_id = {r["id"]: r for r in df.iter_rows(named=True)}
    refused = by_id["r00045"]
    assert refused["error_code"] == "bad_structured_output" and refused["text"] is None
    assert "params.structured_outputs.json: " in refused["error"]
    assert "uniqueItems" in refused["error"] and "in.jsonl:46" in refused["error"]
    assert by_id["r00046"]["error_code"] == "bad_params"
    assert "params.structured_outputs.json: the schema is not JSON" in by_id["r00046"]["error"]


def test_validate_reports_the_same_rows(run):
    root, _ = run
    cwd = os.getcwd()
    os.chdir(root)
    try:
        report = validate(load_job("job.yaml"))
    finally:
        os.chdir(cwd)
    assert dict(report.errors) == {"bad_structured_output": 1, "bad_params": 1}
    assert report.ok == 46


def test_a_lost_shard_is_regenerated_the_same(run, monkeypatch):
    root, df = run
    out = root / "out"
    # An interrupted run: shard 1 and its manifest entry never committed.
    for lost in (out / "part-00001.parquet", out / manifest.MANIFEST_DIR / "part-00001.json"):
        lost.unlink()
    (out / manifest.SUCCESS_FILE).unlink()
    monkeypatch.chdir(root)
    result = Runner(load_job("job.yaml")).run()
    assert result.exit_code == 0 and result.stats.shards_skipped == 2
    again = _read(out)
    for col in df.columns:  # the cache hits differ: the first run's shard 1 had shard 0's
        if col != "num_cached_tokens":
            assert again[col].to_list() == df[col].to_list(), col


def test_a_job_schema_the_engine_refuses_fails_before_the_model_loads(
    tmp_path, monkeypatch, tiny_model_dir
):
    bad = {"type": "object", "not": {"required": ["a"]}}
    job_path = _workspace(tmp_path, tiny_model_dir("llama"), bad)
    monkeypatch.chdir(tmp_path)
    runner = Runner(load_job(str(job_path)))
    with pytest.raises(JobError, match=r"sampling.structured_outputs.json: .*\"not\""):
        runner.prepare()  # every check before the weights load
    assert not (tmp_path / "out").exists()
