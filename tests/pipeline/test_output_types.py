"""Passthrough columns keep their JSON kinds, with one schema in every shard (read by DuckDB)."""

from __future__ import annotations

import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, rows

from batchgen.pipeline.runner import Runner

COLUMNS = ["n", "x", "mixed_num", "flag", "obj", "tags", "sometimes", "anything"]


def record(i: int) -> dict:
    return {
        "n": i,  # int64
        "x": i / 4,  # float64
        "mixed_num": i if i % 3 else i + 0.5,  # ints and floats: float64
        "flag": i % 2 == 0,  # bool
        "obj": {"a": i, "b": {"c": f"s{i}"}, "d": [i, i + 1]},  # struct
        "tags": ["t"] * (i % 3),  # list<string> (some empty)
        "sometimes": None if i % 4 else i,  # int64 with nulls (all null in some shards)
        "anything": [i, "x", {"k": True}, None, 2.5][i % 5],  # truly mixed: JSON text
    }


def test_jsonl_kinds_pass_through_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = [{**r, **record(i)} for i, r in enumerate(rows(40))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    job = load(make_job(tmp_path, "in.jsonl", input={"columns": COLUMNS}, output={"shard_rows": 3}))
    logs: list[str] = []
    result = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=512),
        tokenizer_factory=lambda j: FakeTokenizer(),
        log=logs.append,
    ).run()
    assert result.complete
    assert any("'anything' has several types" in m and "written as text" in m for m in logs)
    assert "written as text (their values mix kinds): anything" in result.lines
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 14
    schemas = {pq.read_schema(p).remove_metadata() for p in parts}
    assert len(schemas) == 1  # one schema in every shard, the all-null ones included
    schema = schemas.pop()
    want = {
        "n": pa.int64(),
        "x": pa.float64(),
        "mixed_num": pa.float64(),
        "flag": pa.bool_(),
        "obj": pa.struct(
            [("a", pa.int64()), ("b", pa.struct([("c", pa.string())])), ("d", pa.list_(pa.int64()))]
        ),
        "tags": pa.list_(pa.string()),
        "sometimes": pa.int64(),
        "anything": pa.string(),
    }
    assert {c: schema.field(c).type for c in COLUMNS} == want
    got = duckdb.sql(f"select id, {', '.join(COLUMNS)} from 'out/*.parquet' order by id").fetchall()
    assert len(got) == 40
    for (row_id, *values), src in zip(got, data):
        assert row_id == src["id"]
        expect = record(int(row_id[1:]))  # floats here are exact in binary
        text = expect["anything"]
        expect["anything"] = text if text is None or isinstance(text, str) else json.dumps(text)
        assert dict(zip(COLUMNS, values)) == expect, row_id
