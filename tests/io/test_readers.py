"""Readers: file discovery, format detection, per-line errors, chunked Parquet, duplicates."""

from __future__ import annotations

import json

import pytest
from workspace import rows, write_jsonl, write_parquet

from batchgen.io.readers import Reader, check_columns, file_format, resolve_inputs
from batchgen.job import InputSpec, JobError


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
    # The column sampling (format detection, check_columns) skips them too.
    check_columns([str(p)], InputSpec(path=str(p)), ["text"])


def test_utf8_bom_at_the_start_of_a_file(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n')
    got = read_all([str(p)])
    assert [(r.id, r.error_code) for r in got] == [("a", None), ("b", None)]
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
