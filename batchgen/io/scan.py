"""One streaming pass over a job's input that makes its shard plan.

It reads every unit once, through the job's own reader (so units, ids and errors are exactly
what a run will see), and keeps: each shard's first Position, each unit's id as a 64-bit hash
(dup_ids: 8 bytes a unit, 16 at the peak), and the passthrough columns' types (arrow_types,
block by block). Nothing else of a row outlives its chunk, so memory does not grow with the
input beyond those 8-16 bytes a unit.

JSONL input of row units (`lines`: one unit a line) takes a leaner path: lines are judged by
readers.parse_line, the function the Reader itself uses, without building row objects; and
several processes (`workers`) can share it: the files are cut into byte ranges at line ends, a
first pass counts each range's rows and lines (so each range knows the index and line number
it starts at), then each worker scans its range; their results are joined in input order.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from batchgen.io.arrow_types import MIXED, ColumnTypes, describe, merge
from batchgen.io.dup_ids import DuplicateFinder
from batchgen.io.readers import lines_from, parse_line
from batchgen.io.rows import InputRow, Position
from batchgen.io.shard_plan import ShardPlan

RANGE_BYTES = 64 << 20  # the byte range a worker scans at a time

# reader(start, first_index, limit) -> chunks of units (no de-duplication), from `start` on.
ReaderFactory = Callable[[Position | None, int, int | None], Iterable[list[InputRow]]]


def scan(
    read: ReaderFactory,
    files: list[str],
    formats: list[str],
    passthrough: list[str],
    footer_types: Callable[[str], dict],
    shard_rows: int,
    key: str,
    settings: dict,
    log: Callable[[str], None] = lambda m: None,
    workers: int = 1,
    lines: LineSpec | None = None,
    stopped: Callable[[], bool] = lambda: False,
) -> ShardPlan:
    """Scan the input once and return its plan.

    Args:
        read: the job's reader from a position (see ReaderFactory); picklable for workers.
        files / formats: the input files and their formats, in reading order.
        passthrough: the columns copied to the output (their types are fixed here).
        footer_types: a Parquet file's {column: Arrow type} from its footer.
        shard_rows: units per shard.
        key / settings: what the plan depends on (see shard_plan.plan_key).
        workers: processes to scan with (with `lines` only).
        lines: given when a unit is one line of JSONL input: how a line is judged.
        stopped: polled as the scan goes; once true the scan raises ScanStopped.
    """
    started = time.monotonic()
    types = ColumnTypes(passthrough)
    for path, fmt in zip(files, formats):
        if fmt == "parquet":
            found = footer_types(path)
            for c in passthrough:
                if c in found:
                    types.add_type(c, found[c], path)
    if lines is not None and "parquet" not in formats:
        ranges = split_ranges(files, RANGE_BYTES if workers > 1 else 1 << 62)
        task = _LineScan(files, formats, lines, passthrough, shard_rows)
        part = _scan_parallel(task, ranges, workers, stopped)
    else:
        chunks = read(None, 0, None)
        part = _scan_units(chunks, files, formats, passthrough, shard_rows, stopped)
    finder = DuplicateFinder()
    for block in part.hashes:
        finder.add_hashes(block)
    for c in passthrough:
        for kind, where in part.origins.get(c, {}).items():
            types.origins[c].setdefault(kind, where)
        types.types[c] = _merge_into(types.types[c], part.types.get(c))
    dup_bytes = finder.nbytes
    num_units, starts = part.num_units, part.starts

    def fetch(indexes: list[int]) -> list[str]:
        return _ids_at(read, starts, shard_rows, indexes)

    duplicates = finder.finish(fetch)
    columns = types.result()
    notes = []
    for c, t in columns.items():
        if t == MIXED:
            seen = ", ".join(f"{kind} in {where}" for kind, where in types.origins[c].items())
            notes.append(f"input: column {c!r} has several types ({seen}); it is written as text")
    log(
        f"plan: {num_units} units in {len(starts)} shard(s), {len(duplicates)} duplicate id(s), "
        f"in {time.monotonic() - started:.1f} s ({dup_bytes / max(num_units, 1):.0f} bytes a "
        f"unit of id hashes); column types: "
        + (", ".join(f"{c} {describe(t)}" for c, t in columns.items()) or "none")
    )
    return ShardPlan(
        key=key,
        shard_rows=shard_rows,
        num_units=num_units,
        starts=starts,
        duplicates=duplicates,
        columns=columns,
        notes=notes,
        settings=settings,
    )


def _merge_into(t, more):
    return t if more is None else merge(t, more)


@dataclass
class _Part:
    """What the scan of some consecutive units found."""

    num_units: int = 0
    starts: list[Position] = field(default_factory=list)
    hashes: list[np.ndarray] = field(default_factory=list)
    types: dict = field(default_factory=dict)
    origins: dict = field(default_factory=dict)


class ScanStopped(Exception):
    """A stop signal came while the input was being scanned."""


def _scan_units(
    chunks: Iterable[list[InputRow]],
    files: list[str],
    formats: list[str],
    passthrough: list[str],
    shard_rows: int,
    stopped: Callable[[], bool],
) -> _Part:
    types = ColumnTypes(passthrough)
    finder = DuplicateFinder()
    part = _Part()
    for chunk in chunks:
        if stopped():
            raise ScanStopped
        ids: list[str | None] = []
        values: dict[str, list] = {c: [] for c in passthrough}
        for unit in chunk:
            if unit.index % shard_rows == 0:
                part.starts.append(unit.pos)
            ids.append(unit.id if unit.error_code is None else None)
            if unit.data is not None and formats[unit.pos.file] != "parquet":
                for c in passthrough:
                    values[c].append(unit.data.get(c))
        part.num_units += len(chunk)
        finder.add(ids)
        for c, vals in values.items():
            if vals:
                types.add_values(c, vals, files[chunk[0].pos.file])
    part.hashes = finder.blocks()
    part.types, part.origins = dict(types.types), types.origins
    return part


def split_ranges(files: list[str], size: int) -> list[tuple[int, int, int]]:
    """(file, start, stop) byte ranges of about `size` bytes, cut after a newline."""
    out = []
    for i, path in enumerate(files):
        total = os.path.getsize(path)
        start = 0
        with open(path, "rb") as f:
            while start < total:
                stop = min(total, start + size)
                if stop < total:
                    f.seek(stop)
                    stop = min(total, stop + len(f.readline()))
                out.append((i, start, stop))
                start = stop
    return out


def _count_range(path: str, start: int, stop: int, limit: int) -> tuple[int, int]:
    """(rows, lines) in a byte range of a JSONL file cut at line ends: rows are its non-blank
    lines and its lines over `limit` bytes, as the reader counts them (through the reader's
    own line splitting, so a BOM or a long line is judged alike)."""
    rows = lines = 0
    with open(path, "rb") as f:
        for _, _, raw, _ in lines_from(f, limit, start, stop=stop):
            lines += 1
            rows += raw is None or bool(raw.strip())
    return rows, lines


@dataclass(frozen=True)
class LineSpec:
    """How the lean path reads a line (the format comes with each file): its id column and
    the size over which it is a row_too_large record."""

    id_column: str
    max_row_bytes: int


@dataclass(frozen=True)
class _LineScan:
    files: list[str]
    formats: list[str]
    lines: LineSpec
    passthrough: list[str]
    shard_rows: int

    def count(self, where: tuple[int, int, int]) -> tuple[int, int]:
        i, start, stop = where
        return _count_range(self.files[i], start, stop, self.lines.max_row_bytes)

    def scan(self, job: tuple[tuple[int, int, int], int, int], stopped=None) -> _Part:
        """The units of byte range `where`, the first being unit `index` on line `line`
        (`stopped`: polled, in this process only)."""
        (i, start, stop), index, line = job
        path, fmt = self.files[i], self.formats[i]
        types = ColumnTypes(self.passthrough)
        finder = DuplicateFinder()
        part = _Part()
        ids: list[str | None] = []
        values: dict[str, list] = {c: [] for c in self.passthrough}

        def flush() -> None:
            finder.add(ids)
            for c, vals in values.items():
                if vals:
                    types.add_values(c, vals, path)
                vals.clear()
            ids.clear()

        key, limit = self.lines.id_column, self.lines.max_row_bytes
        with open(path, "rb") as f:
            for lineno, at, raw, size in lines_from(f, limit, start, line, stop):
                if raw is not None and not raw.strip():
                    continue  # a blank line: no unit
                if index % self.shard_rows == 0:
                    part.starts.append(Position(i, at, lineno))
                row_id, data, code, _ = parse_line(raw, fmt, key, self.passthrough, size, limit)
                ids.append(row_id if code is None else None)
                if data is not None:
                    for c in self.passthrough:
                        values[c].append(data.get(c))
                index += 1
                if len(ids) >= 4096:
                    flush()
                    if stopped is not None and stopped():
                        raise ScanStopped
        flush()
        part.num_units = finder.num_units
        part.hashes = finder.blocks()
        part.types, part.origins = dict(types.types), types.origins
        return part


def _call(args):
    method, arg = args
    return method(arg)


def _scan_parallel(
    task: _LineScan, ranges: list[tuple[int, int, int]], workers: int, stopped: Callable
) -> _Part:
    """Count each range's rows and lines, then scan the ranges; in `workers` processes when
    there are several ranges."""
    if workers > 1 and len(ranges) > 1:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        pool = ProcessPoolExecutor(min(workers, len(ranges)), mp_context=context)
        run = lambda method, args: pool.map(_call, [(method, a) for a in args])  # noqa: E731
    else:
        pool = None
        run = lambda method, args: map(method, args)  # noqa: E731
    try:
        if pool is None:  # one range a file, in order: each starts where the last ended
            parts, index = [], 0
            for where in ranges:
                parts.append(task.scan((where, index, 1), stopped))
                index += parts[-1].num_units
        else:
            counts = list(run(task.count, ranges))
            jobs, index, line = [], 0, {}
            for where, (rows, newlines) in zip(ranges, counts):
                jobs.append((where, index, line.get(where[0], 1)))
                index += rows
                line[where[0]] = line.get(where[0], 1) + newlines
            parts = run(task.scan, jobs)
        whole = _Part()
        for part in parts:
            if stopped():
                raise ScanStopped
            whole.num_units += part.num_units
            whole.starts += part.starts
            whole.hashes += part.hashes
            for c, t in part.types.items():
                whole.types[c] = _merge_into(whole.types.get(c, t), t)
            for c, kinds in part.origins.items():
                for kind, where in kinds.items():
                    whole.origins.setdefault(c, {}).setdefault(kind, where)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return whole


def _ids_at(
    read: ReaderFactory, starts: list[Position], shard_rows: int, indexes: list[int]
) -> list[str]:
    """The ids of the given units (ascending), each shard read from its start."""
    wanted = iter(indexes)
    out: list[str] = []
    nxt = next(wanted, None)
    while nxt is not None:
        k = nxt // shard_rows
        stop = (k + 1) * shard_rows
        for chunk in read(starts[k], k * shard_rows, shard_rows):
            for unit in chunk:
                while nxt is not None and unit.index == nxt:
                    out.append(str(unit.id))
                    nxt = next(wanted, None)
            if nxt is None or nxt >= stop:
                break
        if nxt is not None and nxt < stop:
            raise RuntimeError(f"plan: unit {nxt} was not found again in shard {k}")
    return out
