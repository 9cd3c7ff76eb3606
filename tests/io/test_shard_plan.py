"""Shard plans: one scan finds each shard's start; reading a shard from there equals reading
the whole input and slicing it (JSONL, Parquet row groups, several files, groups)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.io.parquet_schema import arrow_schema
from batchgen.io.readers import Reader
from batchgen.io.scan import scan
from batchgen.io.score_reader import GroupReader
from batchgen.io.shard_plan import ShardPlan, encode, read_plan, write_plan
from batchgen.job import InputSpec

SPEC = InputSpec(path="x")


def write_inputs(tmp_path):
    """Two JSONL files (blank, bad and duplicate lines, a BOM) and a Parquet file of 5 row
    groups, read in that order."""
    a = tmp_path / "a.jsonl"
    lines = [json.dumps({"id": f"a{i}", "text": f"t{i}", "n": i}) for i in range(23)]
    lines[4] = "{broken"
    lines[9] = ""
    lines[12] = json.dumps({"id": "a3", "text": "dup", "n": 1.5})
    a.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"id": f"b{i}", "text": "x", "n": i}) + "\n" for i in range(6)))
    c = tmp_path / "c.parquet"
    ids = [f"c{i}" for i in range(37)]
    ids[20] = "b2"  # a duplicate of a JSONL row
    table = pa.table({"id": ids, "text": [f"p{i}" for i in range(37)], "n": list(range(37))})
    pq.write_table(table, c, row_group_size=8)
    return [str(a), str(b), str(c)]


def make_plan(files, reader_cls, shard_rows, **kw):
    formats = ["parquet" if f.endswith(".parquet") else "jsonl" for f in files]

    def read(start, first_index, limit):
        return reader_cls(files, start=start, first_index=first_index, limit=limit, dedup=False)

    return scan(read, files, formats, ["n"], arrow_schema, shard_rows, "key", {}, **kw)


def rows(reader) -> list[tuple]:
    return [(u.index, u.id, u.error_code, u.source, u.data) for c in reader for u in c]


@pytest.mark.parametrize("shard_rows", [1, 5, 8, 13, 100])
def test_each_shard_read_from_its_start_equals_the_whole_read(tmp_path, shard_rows):
    files = write_inputs(tmp_path)
    plan = make_plan(files, lambda f, **kw: Reader(f, SPEC, ["text", "n"], 3, **kw), shard_rows)
    whole = rows(Reader(files, SPEC, ["text", "n"], 4))  # dedup as a run without a plan does
    assert plan.num_units == len(whole) == 22 + 6 + 37
    assert plan.duplicates == [i for i, *rest in whole if rest[1] == "duplicate_id"]
    assert len(plan.duplicates) == 2
    assert plan.columns["n"] == pa.float64()  # ints and 1.5 in JSONL, int64 in Parquet
    for k in range(plan.num_shards):
        first, stop = plan.shard_units(k)
        reader = Reader(
            files,
            SPEC,
            ["text", "n"],
            3,
            start=plan.starts[k],
            first_index=first,
            limit=stop - first,
            duplicates=plan.duplicates_in(k),
        )
        assert rows(reader) == whole[first:stop], k


def test_group_units_seek_to_their_first_row(tmp_path):
    path = tmp_path / "g.jsonl"
    recs = []
    for g in range(12):
        recs += [{"g": f"g{g % 10}", "t": "p", "c": f"c{j}"} for j in range(1 + g % 3)]
    recs.insert(7, {"t": "no group"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    files = [str(path)]

    def group_reader(f, **kw):
        return GroupReader(f, SPEC, ["t", "c"], "g", 2, **kw)

    plan = make_plan(files, group_reader, 4)
    whole = rows(GroupReader(files, SPEC, ["t", "c"], "g", 5))
    assert plan.num_units == len(whole) == 13
    assert plan.duplicates == [11, 12]  # g0 and g1 come back after other groups
    for k in range(plan.num_shards):
        first, stop = plan.shard_units(k)
        got = GroupReader(
            files, SPEC, ["t", "c"], "g", 2, start=plan.starts[k], first_index=first,
            limit=stop - first, duplicates=plan.duplicates_in(k),
        )  # fmt: skip
        assert rows(got) == whole[first:stop], k


def test_plan_file_round_trip_is_byte_stable(tmp_path):
    files = write_inputs(tmp_path)
    reader = lambda f, **kw: Reader(f, SPEC, ["text", "n"], 5, **kw)  # noqa: E731
    one, two = make_plan(files, reader, 7), make_plan(files, reader, 7)
    assert encode(one) == encode(two)  # racing planners write the same bytes
    write_plan(str(tmp_path), one)
    back = read_plan(str(tmp_path), "key")
    assert isinstance(back, ShardPlan) and encode(back) == encode(one)
    assert read_plan(str(tmp_path), "another key") is None


def test_workers_over_byte_ranges_make_the_same_plan(tmp_path, monkeypatch):
    from batchgen.io import scan as scan_module
    from batchgen.job.spec import JobSpec, ModelSpec, OutputSpec, PromptSpec, SamplingSpec
    from batchgen.pipeline.job_plan import UnitReader

    files = write_inputs(tmp_path)[:2]  # JSONL only: a BOM, blank, bad and duplicate lines
    c = tmp_path / "c.jsonl"
    # Lines over input.max_row_bytes (80) are row_too_large records: one whose id repeats an
    # earlier id (an error record is no duplicate), and one of spaces only (a row, not blank).
    long_dup = json.dumps({"id": "a5", "text": "w" * 100})
    c.write_text("\n\n" + "".join(json.dumps({"id": f"c{i}", "text": "y", "n": [i]}) + "\n"
                                  for i in range(40)) + long_dup + "\n" + " " * 90 + "\n"
                 + '{"id": "a7", "text": "z"}')  # fmt: skip
    files.append(str(c))
    job = JobSpec(
        model=ModelSpec(path="m"),
        input=InputSpec(path="x", columns=("n",), max_row_bytes=80),
        prompt=PromptSpec(template="{text}"),
        sampling=SamplingSpec(),
        output=OutputSpec(path="out", shard_rows=7),
    )
    read = UnitReader(job, files, ["text", "n"])
    formats = ["jsonl"] * 3
    one = scan(read, files, formats, ["n"], arrow_schema, 7, "k", {})  # the Reader, unit by unit
    lines = scan_module.LineSpec("id", max_row_bytes=80)
    lean = scan(read, files, formats, ["n"], arrow_schema, 7, "k", {}, lines=lines)
    assert encode(lean) == encode(one)
    monkeypatch.setattr(scan_module, "RANGE_BYTES", 97)  # ranges of a line or two
    assert len(scan_module.split_ranges(files, 97)) > 10
    many = scan(read, files, formats, ["n"], arrow_schema, 7, "k", {}, workers=2, lines=lines)
    assert encode(many) == encode(one)  # the same bytes, whatever the number of workers
    assert many.num_units == 22 + 6 + 43 and len(many.duplicates) == 2
    assert many.notes == one.notes and many.notes  # n: numbers in a and b, lists in c
    units = [u for chunk in read(None, 0, None) for u in chunk]
    too_large = [u.source for u in units if u.error_code == "row_too_large"]
    assert too_large == [f"{c}:43", f"{c}:44"]


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads /proc/self/io")
def test_a_parquet_shard_reads_only_its_row_groups(tmp_path):
    path = tmp_path / "big.parquet"
    n = 200_000
    table = pa.table({"id": [f"r{i}" for i in range(n)], "text": [f"t{i} " * 10 for i in range(n)]})
    pq.write_table(table, path, row_group_size=10_000, compression="none")  # 20 row groups
    plan = make_plan([str(path)], lambda f, **kw: Reader(f, SPEC, ["text"], 500, **kw), 2_000)
    first, stop = plan.shard_units(plan.num_shards - 1)
    before = bytes_read()
    # As a run reads a shard: in one chunk (a chunk re-reads the row groups it lies in).
    reader = Reader([str(path)], SPEC, ["text"], stop - first, start=plan.starts[-1],
                    first_index=first, limit=stop - first)  # fmt: skip
    got = [u.id for c in reader for u in c]
    assert got == [f"r{i}" for i in range(first, stop)]
    assert bytes_read() - before < os.path.getsize(path) / 10  # its row group, not all 20
