"""One streaming pass over a job's input that makes its shard plan.

It reads every unit once, through the job's own reader (so units, ids and errors are exactly
what a run will see), and keeps: each shard's first Position, each unit's id as a 64-bit hash
(dup_ids: 8 bytes a unit, 16 at the peak), and the passthrough columns' types (arrow_types,
block by block). Nothing else of a row outlives its chunk, so memory does not grow with the
input beyond those 8-16 bytes a unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from batchgen.io.arrow_types import MIXED, ColumnTypes, describe
from batchgen.io.dup_ids import DuplicateFinder
from batchgen.io.rows import InputRow, Position
from batchgen.io.shard_plan import ShardPlan

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
) -> ShardPlan:
    """Scan the input once and return its plan.

    Args:
        read: the job's reader from a position (see ReaderFactory).
        files / formats: the input files and their formats, in reading order.
        passthrough: the columns copied to the output (their types are fixed here).
        footer_types: a Parquet file's {column: Arrow type} from its footer.
        shard_rows: units per shard.
        key / settings: what the plan depends on (see shard_plan.plan_key).
    """
    started = time.monotonic()
    types = ColumnTypes(passthrough)
    for path, fmt in zip(files, formats):
        if fmt == "parquet":
            found = footer_types(path)
            for c in passthrough:
                if c in found:
                    types.add_type(c, found[c], path)
    finder = DuplicateFinder()
    starts: list[Position] = []
    num_units = 0
    for chunk in read(None, 0, None):
        ids: list[str | None] = []
        values: dict[str, list] = {c: [] for c in passthrough}
        for unit in chunk:
            if unit.index % shard_rows == 0:
                starts.append(unit.pos)
            ids.append(unit.id if unit.error_code is None else None)
            if unit.data is not None and formats[unit.pos.file] != "parquet":
                for c in passthrough:
                    values[c].append(unit.data.get(c))
        num_units += len(chunk)
        finder.add(ids)
        for c, vals in values.items():
            if vals:
                types.add_values(c, vals, files[chunk[0].pos.file])
    dup_bytes = finder.nbytes

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
