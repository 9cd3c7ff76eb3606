"""Partial shards: the finished rows of an unfinished shard, committed when a run stops.

Layout: `<output>/_partial/part-00003.p0001.parquet` (the rows, each tagged with its unit
index) and `<output>/_partial/part-00003.p0001.json` (its entry: fingerprint, file, size,
sha256, the units it holds as [start, stop) `unit_ranges`, and the rows' counters). The data file is
published first, then the entry; the entry is the commit. Piece numbers are taken with
link(), so two writers never share one.

A resumed run generates only the units no committed piece holds, then merges the pieces and
its own rows into the shard's one part file and removes the pieces. Pieces of a shard whose
part file is committed are superseded and removed by whoever sees them. Two pieces may hold
the same unit only if a holder kept working after losing its lock; the first piece (by
number) that holds a unit is used and the overlapping later one ignored whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass

from batchgen.io import atomic
from batchgen.io.writer import Batch, ShardLayout, publish_file, read_batch

PARTIAL_DIR = "_partial"
PIECE = re.compile(r"^part-(\d{5})\.p(\d{4,})\.(parquet|jsonl|json)$")


@dataclass
class Piece:
    """A committed piece of shard `k` (its entry verified against its data file)."""

    k: int
    number: int
    entry: dict

    @property
    def units(self) -> set[int]:
        return {u for a, b in self.entry["unit_ranges"] for u in range(a, b)}


def partial_dir(out_dir: str) -> str:
    return os.path.join(out_dir, PARTIAL_DIR)


def _listing(out_dir: str) -> tuple[str, list[str]]:
    """_partial/ and its names; none if it is absent or a symlink (batchgen creates none)."""
    d = partial_dir(out_dir)
    return d, os.listdir(d) if os.path.isdir(d) and not os.path.islink(d) else []


def _name(k: int, number: int, ext: str) -> str:
    return f"part-{k:05d}.p{number:04d}.{ext}"


def unit_ranges(units: list[int]) -> list[list[int]]:
    """Sorted unit indexes as [start, stop) ranges."""
    out: list[list[int]] = []
    for u in sorted(set(units)):
        if out and out[-1][1] == u:
            out[-1][1] = u + 1
        else:
            out.append([u, u + 1])
    return out


def _read(path: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a planted symlink is not followed
        with open(fd, encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def list_pieces(out_dir: str, fingerprint: str) -> dict[int, list[Piece]]:
    """Committed pieces of this job by shard, in piece-number order (one directory listing)."""
    d, names = _listing(out_dir)
    found: dict[int, list[Piece]] = {}
    for name in sorted(names):
        m = PIECE.match(name)
        if m is None or m.group(3) != "json":
            continue
        entry = _read(os.path.join(d, name))
        if entry is None or entry.get("fingerprint") != fingerprint:
            continue
        try:
            if os.path.getsize(os.path.join(d, str(entry.get("file")))) != entry.get("size"):
                continue
        except OSError:
            continue
        k = int(m.group(1))
        found.setdefault(k, []).append(Piece(k, int(m.group(2)), entry))
    for pieces in found.values():
        pieces.sort(key=lambda p: p.number)
    return found


def usable(pieces: list[Piece]) -> tuple[list[Piece], set[int]]:
    """The pieces to build on (no unit twice, earliest first) and the units they hold."""
    taken, done = [], set()
    for p in pieces:
        units = p.units
        if units & done:
            continue  # overlaps an earlier piece: a lost lock's late commit
        taken.append(p)
        done |= units
    return taken, done


def commit_piece(
    out_dir: str, k: int, batch: Batch, layout: ShardLayout, fields: dict
) -> dict | None:
    """Commit a batch of shard k's rows as its next piece; returns the entry (None for an
    empty batch). `fields`: fingerprint and counters for the entry."""
    if not batch.num_rows:
        return None
    d = atomic.own_dir(partial_dir(out_dir))
    ext = "jsonl" if layout.fmt == "openai-batch" else "parquet"
    number = 1 + max(
        (int(m.group(2)) for n in os.listdir(d) if (m := PIECE.match(n)) and int(m.group(1)) == k),
        default=0,
    )
    entry = {**fields, "shard": k, "unit_ranges": unit_ranges(batch.units), "rows": batch.num_rows}
    while True:
        final = os.path.join(d, _name(k, number, ext))
        published, size, sha = publish_file(final, batch, layout, entry, units=True)
        if published:
            break
        number += 1  # taken by another writer: the next number
    entry.update(file=os.path.basename(final), size=size, sha256=sha, piece=number)
    entry["committed_at"] = time.time()
    data = (json.dumps(entry, indent=2, sort_keys=True) + "\n").encode()
    atomic.publish_bytes(os.path.join(d, _name(k, number, "json")), data)
    return entry


def read_pieces(out_dir: str, pieces: list[Piece], layout: ShardLayout) -> list[Batch]:
    return [read_batch(os.path.join(partial_dir(out_dir), p.entry["file"]), layout) for p in pieces]


def remove_pieces(out_dir: str, k: int) -> None:
    """Remove every piece file of shard k (entries first: no entry outlives its data)."""
    d, names = _listing(out_dir)
    names = [n for n in names if (m := PIECE.match(n)) and int(m.group(1)) == k]
    for name in sorted(names, key=lambda n: not n.endswith(".json")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(d, name))


def remove_superseded(out_dir: str, committed: set[int]) -> None:
    """Remove the pieces of committed shards, and `_partial/` itself once empty."""
    d, names = _listing(out_dir)
    for name in names:
        m = PIECE.match(name)
        if m and int(m.group(1)) in committed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
    with contextlib.suppress(OSError):
        os.rmdir(d)
