"""Score mode's group layout: consecutive rows sharing a group id are read as one unit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace

from batchgen.io.readers import Reader
from batchgen.io.rows import InputRow
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
    ):
        self.rows = _RowReader(files, replace(spec, id_column=group_column), columns, chunk_rows)
        self.group_column = group_column
        self._next_index = 0  # units yielded so far (the runner's row total)
        self._seen: set[bytes] = set()

    def __iter__(self) -> Iterator[list[InputRow]]:
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
        key = hashlib.blake2b(str(first.id).encode("utf-8", "surrogatepass"), digest_size=8)
        if key.digest() in self._seen:
            unit.error_code = "duplicate_id"
            unit.error = (
                f"{first.source}: group {first.id!r} appeared earlier, not next to these rows; "
                f"rows of one group must be consecutive (sort the input by "
                f"{self.group_column!r})"
            )
        self._seen.add(key.digest())
        return unit
