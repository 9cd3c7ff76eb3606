"""Score mode's group layout: consecutive rows sharing a group id are read as one unit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace

from batchgen.io.readers import Reader
from batchgen.io.rows import InputRow, Position
from batchgen.job import InputSpec

MEMBERS_KEY = "__members__"  # a group unit's data: its rows as (source, data) pairs


class _RowReader(Reader):
    """A Reader whose ids are group ids: repeats are expected, so rows are not de-duplicated."""

    def _dedup(self, row: InputRow) -> InputRow:
        return row


class GroupReader:
    """Yields one InputRow per group (index = group number), in chunks.

    A group is a run of consecutive readable rows with the same group id; its data holds the
    first row's columns plus MEMBERS_KEY (every row's source and columns, candidate order). A
    group id seen in an earlier run becomes a "duplicate_id" unit (its rows keep their
    members, so each candidate still gets an error record). An unreadable row (bad JSON,
    missing group id) is a unit of its own and ends the current group.
    """

    def __init__(
        self,
        files: list[str],
        spec: InputSpec,
        columns: list[str],
        group_column: str,
        chunk_rows: int = 1024,
        start: Position | None = None,
        first_index: int = 0,
        duplicates: set[int] | None = None,
        dedup: bool = True,
        limit: int | None = None,
    ):
        spec = replace(spec, id_column=group_column)
        self.rows = _RowReader(files, spec, columns, chunk_rows, start, dedup=False)
        self.group_column = group_column
        self._next_index = first_index  # the next unit's index (at the end: the unit total)
        self.duplicates = duplicates  # the shard plan's duplicate unit indexes
        self.dedup = dedup and duplicates is None
        self._seen: set[bytes] = set()
        self.stop_index = None if limit is None else first_index + limit

    def __iter__(self) -> Iterator[list[InputRow]]:
        if self.stop_index is None:
            yield from self._units()
            return
        for units in self._units():
            if units[-1].index >= self.stop_index:
                yield [u for u in units if u.index < self.stop_index]
                return
            yield units

    def _units(self) -> Iterator[list[InputRow]]:
        group: list[InputRow] = []
        for chunk in self.rows:
            units = []
            for row in chunk:
                if group and (row.error_code is not None or row.id != group[0].id):
                    units.append(self._unit(group))
                    group = []
                if row.error_code is not None:
                    units.append(self._renumber(row))
                else:
                    group.append(row)
            if units:
                yield units
        if group:
            yield [self._unit(group)]

    def _renumber(self, row: InputRow) -> InputRow:
        row = replace(row, index=self._next_index)
        self._next_index += 1
        return row

    def _unit(self, rows: list[InputRow]) -> InputRow:
        first = rows[0]
        data = dict(first.data or {})
        data[MEMBERS_KEY] = [(r.source, r.data or {}) for r in rows]
        unit = self._renumber(replace(first, data=data))
        if self.duplicates is not None:
            repeated = unit.index in self.duplicates
        elif self.dedup:
            key = hashlib.blake2b(str(first.id).encode("utf-8", "surrogatepass"), digest_size=8)
            repeated = key.digest() in self._seen
            self._seen.add(key.digest())
        else:
            repeated = False
        if repeated:
            unit.error_code = "duplicate_id"
            unit.error = (
                f"{first.source}: group {first.id!r} appeared earlier, not next to these rows; "
                f"rows of one group must be consecutive (sort the input by "
                f"{self.group_column!r})"
            )
        return unit
