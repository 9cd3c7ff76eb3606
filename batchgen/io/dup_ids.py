"""Exact duplicate-id detection over a stream of ids in about 8.5 bytes a row.

Each unit's id is kept only as a 64-bit hash, in unit order (8 bytes a unit). At the end the
hash values held by more than one unit are found one bucket at a time (the hashes whose top 4
bits are b, sorted: 1/16 of them, half a byte a unit, at the peak); the units holding those
values are the candidates. Their ids are read again (`fetch`) and compared exactly: the first
occurrence of an id wins, each later one is a duplicate. A hash collision between two
different ids only makes both candidates, never a false duplicate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import polars as pl

# polars is imported where ids are hashed: importing the planner (the runner, the CLI) must
# not need it.

NO_ID = np.uint64(0)  # the hash slot of a unit without a usable id (an error row)
BUCKET_BITS = 4  # repeated hashes are found in 2**4 buckets by their top bits


def _hashes(series: pl.Series) -> np.ndarray:
    """64-bit hashes of a block of ids (polars' vectorized hash, fixed seed)."""
    return series.hash(seed=0x5EED).to_numpy()


class DuplicateFinder:
    """Collects ids block by block (`add`), then `finish` lists the duplicate unit indexes."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []  # uint64 hashes, unit order
        self.num_units = 0

    def add(self, ids: list[str | None]) -> None:
        """The ids of the next len(ids) units, in order (None: the unit takes no part)."""
        if not ids:
            return
        import polars as pl

        series = pl.Series(ids, dtype=pl.String)
        hashes = _hashes(series).astype(np.uint64, copy=True)
        hashes[hashes == NO_ID] = 1  # 0 is the no-id mark; a real hash of 0 becomes 1
        missing = series.is_null().to_numpy()
        hashes[missing] = NO_ID
        self._blocks.append(hashes)
        self.num_units += len(ids)

    def add_hashes(self, hashes: np.ndarray) -> None:
        """Hashes made by another finder (`blocks`), for the next units in order."""
        self._blocks.append(hashes)
        self.num_units += len(hashes)

    def blocks(self) -> list[np.ndarray]:
        """The hashes so far, in unit order (to hand to another finder; no copy)."""
        return list(self._blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._blocks)

    def repeated_hashes(self) -> np.ndarray:
        """Hash values held by more than one unit (sorted, without NO_ID)."""
        found = []
        shift = np.uint64(64 - BUCKET_BITS)
        for bucket in range(1 << BUCKET_BITS):
            parts = [b[(b >> shift) == np.uint64(bucket)] for b in self._blocks]
            values = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
            values.sort()
            same = values[1:] == values[:-1]
            if same.any():
                found.append(np.unique(values[1:][same]))
            del parts, values, same
        values = np.concatenate(found) if found else np.empty(0, dtype=np.uint64)
        return values[values != NO_ID]

    def candidates(self, repeated: np.ndarray) -> Iterator[int]:
        """Unit indexes whose hash is one of `repeated`, ascending."""
        base = 0
        for block in self._blocks:
            hits = np.flatnonzero(np.isin(block, repeated, assume_unique=False))
            yield from (base + int(i) for i in hits)
            base += len(block)

    def finish(self, fetch: Callable[[list[int]], list[str]]) -> list[int]:
        """Duplicate unit indexes (every occurrence after an id's first), ascending.

        Args:
            fetch: the exact ids of the given unit indexes (ascending), in the same order.
        """
        repeated = self.repeated_hashes()
        if len(repeated) == 0:
            return []
        candidates = list(self.candidates(repeated))
        ids = fetch(candidates)
        seen: set[str] = set()
        out = []
        for index, unit_id in zip(candidates, ids):
            if unit_id in seen:
                out.append(index)
            seen.add(unit_id)
        return out
