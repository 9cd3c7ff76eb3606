"""input.max_row_bytes: a row over the limit is a row_too_large error record, never held whole."""

from __future__ import annotations

import io
import json

import pytest
from workspace import rows, write_jsonl

from batchgen.io.readers import Reader, bounded_lines, lines_from
from batchgen.io.score_reader import GroupReader
from batchgen.job import InputSpec

# polars writes and reads the Parquet these tests check; without it (the GPU machine runs only
# `pytest -m gpu`) this module is skipped at collection.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")

LIMIT = 1000


def read_all(path, columns=("text",), limit=LIMIT, fmt="auto"):
    spec = InputSpec(path=str(path), format=fmt, max_row_bytes=limit)
    return [r for chunk in Reader([str(path)], spec, list(columns), 5) for r in chunk]


def test_jsonl_line_over_the_limit_is_row_too_large(tmp_path):
    data = rows(6)
    data[2]["text"] = "x" * 5_000_000  # a 5 MB line
    data[4]["text"] = "y" * (LIMIT - len(json.dumps({**data[4], "text": ""})))  # exactly LIMIT
    path = write_jsonl(tmp_path / "in.jsonl", data)
    got = read_all(path)
    assert [r.index for r in got] == list(range(6))
    assert [r.error_code for r in got] == [None, None, "row_too_large", None, None, None]
    assert got[2].error == (
        f"{path}:3: line is {len(json.dumps(data[2])):,} bytes, over input.max_row_bytes=1,000; "
        "shorten the row or raise the limit"
    )
    assert got[4].data["text"] == data[4]["text"]  # a line of exactly the limit is read
    assert [r.id for r in got if r.error_code is None] == [data[i]["id"] for i in (0, 1, 3, 4, 5)]


def test_bounded_lines_never_reads_a_long_line_whole():
    class Recording(io.BytesIO):
        largest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Recording.largest = max(Recording.largest, len(line))
            return line

    data = b"\xef\xbb\xbfshort\r\n" + b"z" * 10_000_000 + b"\nlast-no-newline"
    got = list(bounded_lines(Recording(data), 100))
    assert got == [(1, b"short", 5), (2, None, 10_000_000), (3, b"last-no-newline", 15)]
    assert Recording.largest <= 1 << 20


def test_a_line_of_exactly_the_limit_after_a_bom_is_one_line():
    # The BOM is no content: a first line of `limit` bytes after it is whole, not cut in two.
    data = b"\xef\xbb\xbf" + b"a" * 100 + b"\r\n" + b"b" * 101 + b"\n" + b"c" * 100
    got = list(bounded_lines(io.BytesIO(data), 100))
    assert got == [(1, b"a" * 100, 100), (2, None, 101), (3, b"c" * 100, 100)]


def test_lines_from_an_offset_are_the_lines_read_from_the_start():
    data = b"\xef\xbb\xbf{}\n\n" + b"x" * 50 + b"\n" + b"yy\r\nzzz"
    whole = list(lines_from(io.BytesIO(data), 10))
    assert [(n, c, size) for n, _, c, size in whole] == list(bounded_lines(io.BytesIO(data), 10))
    for i, (n, offset, _, _) in enumerate(whole):  # a reader seeking to a line's start
        assert list(lines_from(io.BytesIO(data), 10, offset, n)) == whole[i:]
        stop = whole[i + 1][1] if i + 1 < len(whole) else None
        assert list(lines_from(io.BytesIO(data), 10, offset, n, stop)) == [whole[i]]


def test_parquet_text_columns_over_the_limit_keep_their_id(tmp_path):
    path = tmp_path / "in.parquet"
    pl.DataFrame(
        {
            "id": ["a", "b", "c", "d"],
            "text": ["ok", "t" * 600, "short", None],
            "title": ["x" * 600, "u" * 600, "v", "w"],
            "n": [1, 2, 3, 4],
        }
    ).write_parquet(path)
    got = read_all(path, columns=("text", "title", "n"))
    assert [r.error_code for r in got] == [None, "row_too_large", None, None]
    assert got[1].id == "b" and got[1].data is None
    assert got[1].error == (
        f"{path}:row 1: its text columns hold 1,200 bytes, over input.max_row_bytes=1,000; "
        "shorten the row or raise the limit"
    )
    assert got[0].data == {"text": "ok", "title": "x" * 600, "n": 1}


def test_score_candidates_lists_count_toward_the_limit(tmp_path):
    path = tmp_path / "in.parquet"
    pl.DataFrame(
        {"id": ["a", "b"], "q": ["?", "?"], "cands": [["c" * 300, "d" * 300], ["e" * 600] * 2]}
    ).write_parquet(path)
    got = read_all(path, columns=("q", "cands"))
    assert [r.error_code for r in got] == [None, "row_too_large"]


def test_grouped_score_rows_over_the_limit_are_their_own_unit(tmp_path):
    data = [{"g": "a", "q": "?", "c": "one"}, {"g": "a", "q": "?", "c": "z" * 5000}]
    data += [{"g": "b", "q": "?", "c": "two"}]
    path = write_jsonl(tmp_path / "in.jsonl", data)
    spec = InputSpec(path=str(path), max_row_bytes=LIMIT)
    units = [u for chunk in GroupReader([str(path)], spec, ["q", "c"], "g") for u in chunk]
    assert [u.error_code for u in units] == [None, "row_too_large", None]
    assert [u.id for u in units] == ["a", None, "b"]


@pytest.mark.parametrize("limit", [0, -5])
def test_max_row_bytes_must_be_positive(tmp_path, limit):
    from batchgen.job import JobError
    from batchgen.job.load import validate_job

    raw = {
        "model": {"path": "m"},
        "input": {"path": "x.jsonl", "max_row_bytes": limit},
        "prompt": {"template": "{text}"},
        "output": {"path": "o"},
    }
    with pytest.raises(JobError, match="input.max_row_bytes"):
        validate_job(raw)
