"""Runs and `validate` with rows too large or holding non-text: error records, nothing lost."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.engine.request_checks import ModelLimits
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.validate import validate


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_rows_over_the_limit_are_error_records_and_the_run_completes(tmp_path):
    data = rows(40)
    data[7]["text"] = "w" * 10_000_000  # a 10 MB row
    data[21]["text"] = "v" * 3000
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl", input={"max_row_bytes": 2048}))
    result = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=256),
        tokenizer_factory=lambda j: FakeTokenizer(),
    ).run()
    assert result.complete
    out = read_output("out")
    assert len(out) == 40  # every row once, the two large ones as error records
    assert out["error_code"].to_list().count("row_too_large") == 2
    big = out.filter(out["error_code"] == "row_too_large")["error"].to_list()
    assert big[0].startswith("in.jsonl:8: line is 10,000,0")
    assert big[1].startswith("in.jsonl:22: line is 3,0")
    ok_ids = out.filter(out["error_code"].is_null())["id"].to_list()
    assert ok_ids == [r["id"] for i, r in enumerate(data) if i not in (7, 21)]


def test_validate_counts_rows_over_the_limit(tmp_path):
    data = rows(5)
    data[3]["text"] = "w" * 5000
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl", input={"max_row_bytes": 2048}))
    report = validate(
        job,
        tokenizer_factory=lambda j: FakeTokenizer(),
        limits_fn=lambda j: ModelLimits(256, FakeTokenizer.vocab_size),
    )
    assert report.rows == 5 and report.ok == 4 and dict(report.errors) == {"row_too_large": 1}


def test_list_and_object_text_values_are_bad_text_records(tmp_path):
    data = rows(6)
    data[1]["text"] = ["a", "list"]
    data[2]["text"] = {"an": "object"}
    data[3]["text"] = 42  # a number is written as its decimal text
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl"))
    result = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=256),
        tokenizer_factory=lambda j: FakeTokenizer(),
    ).run()
    assert result.complete
    out = read_output("out")
    assert out["error_code"].to_list() == [None, "bad_text", "bad_text", None, None, None]
    assert out["error"][1] == (
        "in.jsonl:2: column 'text' holds list ['a', 'list'], not text; prompt columns take "
        "strings (or numbers)"
    )
