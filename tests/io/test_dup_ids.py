"""Exact duplicate ids from 64-bit hashes: collisions are rechecked, never reported as dups."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchgen.io import dup_ids
from batchgen.io.dup_ids import DuplicateFinder

# The GPU machine has no polars (it runs only `pytest -m gpu`): there this module is skipped
# at collection.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")


def reference(ids: list[str | None]) -> list[int]:
    seen, out = set(), []
    for i, x in enumerate(ids):
        if x is None:
            continue
        if x in seen:
            out.append(i)
        seen.add(x)
    return out


def find(ids: list[str | None], block: int = 7) -> list[int]:
    finder = DuplicateFinder()
    for a in range(0, len(ids), block):
        finder.add(ids[a : a + block])
    assert finder.nbytes == 8 * len(ids)  # 8 bytes a unit kept (the sort's copy is the peak)
    fetched = []

    def fetch(indexes):
        fetched.extend(indexes)
        return [ids[i] for i in indexes]

    found = finder.finish(fetch)
    assert fetched == sorted(fetched)
    return found


def test_matches_a_set_over_random_ids():
    rng = random.Random(3)
    ids = [rng.choice([None, *(f"id{rng.randrange(300)}" for _ in range(5))]) for _ in range(2000)]
    assert find(ids) == reference(ids)
    assert find([f"u{i}" for i in range(100)]) == []


def test_every_hash_colliding_is_still_exact(monkeypatch):
    # Force all hashes equal: every unit becomes a candidate and the exact recheck decides.
    def constant(series: pl.Series) -> np.ndarray:
        return np.full(len(series), 12345, dtype=np.uint64)

    monkeypatch.setattr(dup_ids, "_hashes", constant)
    ids = ["a", "b", "a", None, "c", "b", "b", "d"]
    assert find(ids, block=3) == [2, 5, 6]


def test_hash_of_zero_is_not_the_no_id_mark(monkeypatch):
    monkeypatch.setattr(dup_ids, "_hashes", lambda s: np.zeros(len(s), dtype=np.uint64))
    assert find(["x", "y", "x", None, None]) == [2]
