"""The shard plan (`<output>/_plan.json`): where each shard starts, found by one input scan.

Written once per job input (by the first task, or `batchgen plan`), read by every task: a task
seeks straight to its shards' first rows instead of reading the input before them. It holds,
per shard, the Position of its first unit (JSONL: file and byte offset; Parquet: file and row
number, which the reader maps to row groups), the unit count, the duplicate-id findings (the
indexes of units whose id appeared earlier), the passthrough columns' Arrow types and the
input fingerprint it was made from. Its content is a function of the input and the job's
reading settings only (`key`), so tasks racing to plan write the same bytes, each with an
atomic rename. A plan whose key differs (the input or those settings changed) is made again.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from batchgen.io import atomic
from batchgen.io.arrow_types import MIXED, ColumnType, from_json, to_json
from batchgen.io.rows import Position

PLAN_FILE = "_plan.json"
PLAN_VERSION = 1


def plan_key(**settings: Any) -> str:
    """The hash of everything a plan depends on (input fingerprint, reading settings)."""
    data = json.dumps({"version": PLAN_VERSION, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass
class ShardPlan:
    key: str
    shard_rows: int  # units per shard
    num_units: int  # input rows (or groups, score mode's group layout) in the whole input
    starts: list[Position]  # shard k's first unit
    duplicates: list[int] = field(default_factory=list)  # ascending unit indexes
    columns: dict[str, ColumnType] = field(default_factory=dict)  # passthrough types
    notes: list[str] = field(default_factory=list)  # what the scan saw (mixed columns)
    settings: dict = field(default_factory=dict)  # what `key` hashes (for messages)

    @property
    def num_shards(self) -> int:
        return len(self.starts)

    def shard_units(self, k: int) -> tuple[int, int]:
        """[first, stop) unit indexes of shard k."""
        first = k * self.shard_rows
        return first, min(first + self.shard_rows, self.num_units)

    def duplicates_in(self, k: int) -> set[int]:
        first, stop = self.shard_units(k)
        a = bisect.bisect_left(self.duplicates, first)
        b = bisect.bisect_left(self.duplicates, stop)
        return set(self.duplicates[a:b])

    @property
    def mixed_columns(self) -> list[str]:
        return [c for c, t in self.columns.items() if t == MIXED]

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "key": self.key,
            "settings": self.settings,
            "shard_rows": self.shard_rows,
            "num_units": self.num_units,
            "num_shards": self.num_shards,
            "starts": [list(p) for p in self.starts],
            "duplicates": _ranges(self.duplicates),
            "columns": to_json(self.columns),
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, obj: dict) -> ShardPlan:
        return cls(
            key=obj["key"],
            shard_rows=int(obj["shard_rows"]),
            num_units=int(obj["num_units"]),
            starts=[Position(*p) for p in obj["starts"]],
            duplicates=[u for a, b in obj["duplicates"] for u in range(a, b)],
            columns=from_json(obj["columns"]),
            notes=list(obj.get("notes", [])),
            settings=dict(obj.get("settings", {})),
        )


def _ranges(values: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return out


def encode(plan: ShardPlan) -> bytes:
    """The plan file's bytes: the same for the same plan, whoever writes it."""
    return (json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":")) + "\n").encode()


def write_plan(out_dir: str, plan: ShardPlan) -> None:
    atomic.write_bytes(os.path.join(out_dir, PLAN_FILE), encode(plan))


def read_plan(out_dir: str, key: str | None = None) -> ShardPlan | None:
    """The plan in out_dir (None if absent, unreadable, or made for another key)."""
    try:
        fd = os.open(os.path.join(out_dir, PLAN_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, encoding="utf-8") as f:  # a planted symlink is not followed
            obj = json.load(f)
        if obj.get("version") != PLAN_VERSION or (key is not None and obj.get("key") != key):
            return None
        return ShardPlan.from_json(obj)
    except (OSError, ValueError, KeyError, TypeError):
        return None
