"""Readers: file discovery, format detection, per-line errors, chunked Parquet, duplicates."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from workspace import corrupt_column_chunk, rows, write_jsonl, write_parquet, write_row_groups

from batchgen.io.readers import Reader, check_columns, file_format, resolve_inputs
from batchgen.io.score_reader import GroupReader
from batchgen.job import InputSpec, JobError

# polars reads and writes the Parquet these tests check. The GPU machine has none and runs only
# `pytest -m gpu`: there this module is skipped at collection instead of failing it.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")


def read_all(files, spec=None, columns=("text",), chunk_rows=7):
    spec = spec or InputSpec(path="x")
    chunks = list(Reader(files, spec, list(columns), chunk_rows))
    assert all(len(c) <= chunk_rows for c in chunks)
    return [r for c in chunks for r in c]


def test_resolve_file_dir_glob(tmp_path):
    write_jsonl(tmp_path / "d/b.jsonl", rows(1))
    write_parquet(tmp_path / "d/a.parquet", rows(1))
    (tmp_path / "d/_ignored.jsonl").write_text("")
    (tmp_path / "d/readme.txt").write_text("")
    d = str(tmp_path / "d")
    assert [p.split("/")[-1] for p in resolve_inputs(d)] == ["a.parquet", "b.jsonl"]
    assert resolve_inputs(d + "/*.jsonl") == [d + "/b.jsonl"]
    with pytest.raises(JobError, match="matches no input files"):
        resolve_inputs(d + "/*.csv")


def test_resolve_skips_directories_and_refuses_dangling_links(tmp_path):
    write_jsonl(tmp_path / "d/b.jsonl", rows(1))
    (tmp_path / "d/nested.jsonl").mkdir()
    d = str(tmp_path / "d")
    assert resolve_inputs(d) == [d + "/b.jsonl"]
    assert resolve_inputs(d + "/*.jsonl") == [d + "/b.jsonl"]
    (tmp_path / "d/gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(JobError, match="gone.jsonl is a symlink to a missing file"):
        resolve_inputs(d)
    with pytest.raises(JobError, match="gone.jsonl is a symlink to a missing file"):
        resolve_inputs(d + "/gone.jsonl")
    (tmp_path / "d/link.jsonl").symlink_to(tmp_path / "d/b.jsonl")
    assert resolve_inputs(d + "/[bl]*.jsonl") == [d + "/b.jsonl", d + "/link.jsonl"]


def test_jsonl_line_errors(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(
        b'{"id": "a", "text": "x"}\n\n{"id": \n[1, 2]\n{"id": "b\xff"}\n'
        b'{"id": null, "text": "y"}\n{"id": "a", "text": "again"}\n{"id": 5}\n'
    )
    got = read_all([str(p)])
    assert [r.error_code for r in got] == [
        None,
        "bad_json",
        "bad_json",
        "invalid_utf8",
        "missing_id",
        "duplicate_id",
        None,
    ]
    assert [r.index for r in got] == list(range(7))
    assert got[1].source.endswith("in.jsonl:3") and got[6].id == "5"


def test_lines_that_would_crash_later_are_bad_json(tmp_path):
    # Lone surrogate escapes decode but are no text (tokenizer, seed and writer would raise);
    # a deeply nested line overflows the parser's recursion. Each is its row's error record.
    p = tmp_path / "in.jsonl"
    p.write_bytes(
        b'{"id": "a", "text": "ok \\\\ud800 escaped, fine"}\n'
        b'{"id": "b", "text": "lone \\ud800"}\n'
        b'{"id": "c\\uDFFF", "text": "x"}\n'
        b'{"id": "d", "text": "x", "meta": {"k": ["\\udc00"]}}\n'
        b'{"id": "e", "text": "pair \\ud83d\\ude00"}\n' + b"[" * 100000 + b"\n"
        b'{"id": "f", "text": "after"}\n'
    )
    got = read_all([str(p)])
    assert [r.error_code for r in got] == [None, "bad_json", "bad_json", "bad_json", None] + [
        "bad_json",
        None,
    ]
    assert "lone surrogate" in got[1].error and got[1].error.startswith(f"{p}:2: ")
    assert "key 'text'" in got[1].error and "key 'id'" in got[2].error
    assert "key 'meta.k[0]'" in got[3].error
    assert "nested too deeply" in got[5].error
    assert got[4].data["text"] == "pair \U0001f600"
    # The column sampling (format detection, check_columns) skips them too, and lines whose
    # bytes are not UTF-8 (json.loads(bytes) would let a surrogate's own bytes through).
    check_columns([str(p)], InputSpec(path=str(p)), ["text"])
    q = tmp_path / "keys.jsonl"
    q.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "b", "t\xed\xa0\x80": "y"}\n')
    with pytest.raises(JobError, match=r"\(its columns: id, text\)$"):
        check_columns([str(q)], InputSpec(path=str(q)), ["topic"])


def test_utf8_bom_at_the_start_of_a_file(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(
        b'\xef\xbb\xbf{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'
        b'\xef\xbb\xbf{"id": "c", "text": "z"}\n'
    )
    got = read_all([str(p)])
    # Only at the start of the file: elsewhere a BOM is stray bytes in the line.
    assert [(r.id, r.error_code) for r in got] == [("a", None), ("b", None), (None, "bad_json")]
    assert file_format(str(p), "auto") == "jsonl"


def test_parquet_chunks_and_columns(tmp_path):
    data = rows(23)
    data[4]["id"] = None
    p = write_parquet(tmp_path / "in.parquet", data)
    got = read_all([str(p)], columns=("text", "topic"))
    assert len(got) == 23 and got[4].error_code == "missing_id"
    assert got[22].id == "r00022" and got[22].data == {"text": data[22]["text"], "topic": "b"}


def test_openai_batch_detection_and_rows(tmp_path):
    lines = [
        {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
    ]
    p = write_jsonl(tmp_path / "b.jsonl", lines)
    assert file_format(str(p), "auto") == "openai-batch"
    [r] = read_all([str(p)], spec=InputSpec(path="x", format="auto"), columns=())
    assert r.id == "x" and r.data["__openai__"]["body"] == {"prompt": "hi"}


def test_check_columns(tmp_path):
    p = write_parquet(tmp_path / "in.parquet", rows(3))
    check_columns([str(p)], InputSpec(path="x"), ["text", "topic"])
    with pytest.raises(JobError, match=r"column\(s\) 'body' used by the job are not in"):
        check_columns([str(p)], InputSpec(path="x"), ["body"])
    j = tmp_path / "in.jsonl"
    j.write_text(json.dumps({"id": 1, "text": "a"}) + "\n")
    with pytest.raises(JobError, match="'topic'"):
        check_columns([str(j)], InputSpec(path="x"), ["text", "topic"])


def test_ids_are_strings_or_integers(tmp_path):
    # An integer id is its decimal text (so 7 and "7" are one id); anything else has no one
    # obvious text (str() gave "True", "{'a': 1}") and is that row's bad_id error record.
    p = tmp_path / "in.jsonl"
    p.write_text(
        '{"id": 7, "text": "a"}\n{"id": "7", "text": "b"}\n{"id": true, "text": "c"}\n'
        '{"id": 1.5, "text": "d"}\n{"id": [1, 2], "text": "e"}\n{"id": {"a": 1}, "text": "f"}\n'
        '{"id": -3, "text": "g"}\n'
    )
    got = read_all([str(p)])
    assert [(r.id, r.error_code) for r in got] == [
        ("7", None),
        ("7", "duplicate_id"),
        (None, "bad_id"),
        (None, "bad_id"),
        (None, "bad_id"),
        (None, "bad_id"),
        ("-3", None),
    ]
    assert got[2].error == f"{p}:3: id 'id' must be a string or an integer, got bool True"
    assert "got dict {'a': 1}" in got[5].error
    # Score mode's group ids follow the same rule.
    q = write_jsonl(tmp_path / "g.jsonl", [{"g": 1, "t": "x"}, {"g": "1", "t": "y"}, {"g": 1.0}])
    units = [u for c in GroupReader([str(q)], InputSpec(path="x"), ["t"], "g") for u in c]
    assert [(u.id, u.error_code, len(u.data["__members__"]) if u.data else 0) for u in units] == [
        ("1", None, 2),
        (None, "bad_id", 0),
    ]
    assert "id 'g' must be a string or an integer, got float 1.0" in units[1].error


def test_openai_custom_id_rule(tmp_path):
    body = {"url": "/v1/completions", "body": {"prompt": "hi"}}
    lines = [{"custom_id": c, **body} for c in ("x", 12, False, ["x"])]
    p = write_jsonl(tmp_path / "b.jsonl", lines)
    got = read_all([str(p)], spec=InputSpec(path="x", format="openai-batch"), columns=())
    assert [(r.id, r.error_code) for r in got] == [
        ("x", None),
        ("12", None),
        (None, "bad_id"),
        (None, "bad_id"),
    ]
    assert "id 'custom_id' must be a string or an integer, got list ['x']" in got[3].error


def test_parquet_id_column_types(tmp_path):
    ints = write_parquet(tmp_path / "ints.parquet", [{"id": i, "text": "t"} for i in range(3)])
    check_columns([str(ints)], InputSpec(path="x"), ["text"])
    assert [r.id for r in read_all([str(ints)])] == ["0", "1", "2"]
    for name, values in [("floats", [1.0, 2.0]), ("bools", [True, False]), ("lists", [[1], [2]])]:
        f = write_parquet(tmp_path / f"{name}.parquet", [{"id": v, "text": "t"} for v in values])
        with pytest.raises(JobError, match=rf"id column 'id' in .*{name}.parquet is .*; ids must"):
            check_columns([str(f)], InputSpec(path="x"), ["text"])


def test_parquet_undecodable_row_groups_are_error_records(tmp_path):
    # A corrupt page spoils its row group only: those rows are bad_parquet records (with their
    # ids when the id column still decodes), every other row is read, chunk sizes hold.
    p = write_row_groups(tmp_path / "in.parquet", 50, 10)
    corrupt_column_chunk(p, 2, 1)  # text of rows 20-29
    corrupt_column_chunk(p, 4, 0)  # ids of rows 40-49
    check_columns([str(p)], InputSpec(path="x"), ["text"])  # the footer is fine
    got = read_all([str(p)])
    assert [r.index for r in got] == list(range(50))
    bad = [i for i, r in enumerate(got) if r.error_code == "bad_parquet"]
    assert bad == [*range(20, 30), *range(40, 50)]
    assert all(r.error_code is None and r.data["text"] for r in got if r.index not in bad)
    assert [got[i].id for i in (19, 20, 29, 30, 40)] == ["r19", "r20", "r29", "r30", None]
    assert got[25].error.startswith(f"{p}:row 25: rows 20-29 of this file cannot be decoded (")
    assert "rows 40-49" in got[40].error


def test_parquet_invalid_utf8_is_an_error_record_not_a_surrogate(tmp_path):
    # polars validates UTF-8 (a surrogate's bytes are invalid), so no lone surrogate reaches
    # Python from Parquet; the undecodable row group is bad_parquet.
    raw = pa.array([b"ok", b"bad \xed\xa0\x80"], pa.binary())
    text = pa.Array.from_buffers(pa.string(), 2, raw.buffers())
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "text": text}), p)
    got = read_all([str(p)])
    assert [(r.id, r.error_code) for r in got] == [("a", "bad_parquet"), ("b", "bad_parquet")]
    assert "UTF-8" in got[0].error
    assert pl.read_parquet_schema(p)["text"] == pl.String
