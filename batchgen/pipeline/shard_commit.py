"""Committing a shard: its whole part file (its pieces merged in), or a piece when stopped.

Only the holder of a shard's lock commits it. The part file is published with link() and is
the commit; its manifest entry, published next, records it (a crash between the two leaves a
part file that the next holder adopts). If another process published the part file first, its
file stands and this one is dropped: a shard is never written twice.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable

from batchgen.io import manifest, pieces
from batchgen.io.pieces import Piece
from batchgen.io.writer import (
    Batch,
    ShardLayout,
    encode,
    file_meta,
    merge,
    publish_file,
    shard_file,
    size_and_sha256,
)

_COUNTERS = (
    "ok",
    "errors",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_generated_tokens",
    "num_scored_tokens",
    "units",
)


def add_totals(into: dict, more: dict) -> dict:
    for key in _COUNTERS:
        if key in more:
            into[key] = into.get(key, 0) + int(more[key])
    return into


class ShardCommitter:
    """Writes shard files, entries and pieces for one job.

    Args:
        out_dir: the output directory.
        layout: how rows become columns.
        fingerprint: the job fingerprint (recorded in every entry and Parquet footer).
        mode: the job mode (counters of a list of rows, its coverage check).
        log: where messages go.
        task: the committing task (`--shard I/N` and holder note), recorded in each timeline
            event with the host and this run's start.
    """

    def __init__(
        self,
        out_dir: str,
        layout: ShardLayout,
        fingerprint: str,
        mode,
        log: Callable,
        task: str = "",
    ):
        self.out_dir, self.layout, self.fingerprint = out_dir, layout, fingerprint
        self.mode, self.log = mode, log
        self.origin = {"task": task, "host": socket.gethostname(), "run_started": time.time()}
        self.started: dict[int, float] = {}  # shard -> when this run began working on it

    def note_start(self, k: int) -> None:
        """This run begins work on shard k now (it read the shard's rows)."""
        self.started[k] = time.time()

    def event(self, k: int, rows: int, totals: dict) -> dict:
        """A timeline event: `rows` input rows (units) of shard k and their generated tokens,
        made by this run between `started` (the shard's start, or its last piece) and now.
        `batchgen status --plot` draws throughput and rows over time from these events."""
        now = time.time()
        tokens = int(totals.get("num_generated_tokens", 0))
        started = min(self.started.get(k, now), now)
        self.started[k] = now  # the next rows of this shard are made from now on
        event = {"at": now, "started": started, "rows": rows, "generated_tokens": tokens}
        return {**event, **self.origin}

    def part_path(self, k: int) -> str:
        return os.path.join(self.out_dir, shard_file(k, self.layout.fmt))

    def recover(self, k: int) -> dict | None:
        """Shard k's committed entry, if it is committed: verified, or adopted from a part
        file published without its entry. A part file that is no commit of this job
        (truncated, another job's) and an entry without its data are removed."""
        entry = manifest.read_entries_of(self.out_dir, k)
        if entry is not None and manifest.verify_entry(self.out_dir, entry, self.fingerprint):
            return entry
        path = self.part_path(k)
        if os.path.exists(path):
            adopted = self._adopt(k)
            if adopted is not None:
                return adopted
            self.log(f"shard {k}: removing {os.path.basename(path)}, which is no commit of it")
            os.unlink(path)
        if entry is not None:
            os.unlink(manifest.entry_path(self.out_dir, k))
        return None

    def _adopt(self, k: int) -> dict | None:
        path = self.part_path(k)
        if self.layout.fmt == "openai-batch":
            fields = _jsonl_totals(path)
        else:
            meta = file_meta(path)
            ok = meta is not None and meta.get("fingerprint") == self.fingerprint
            fields = meta if ok and meta.get("shard") == k else None
        if fields is None:
            return None
        size, sha = size_and_sha256(path)
        entry = {**fields, "fingerprint": self.fingerprint, "file": os.path.basename(path)}
        entry.update(size=size, sha256=sha)
        if not manifest.verify_entry(self.out_dir, entry, self.fingerprint):
            return None
        return manifest.publish_entry(self.out_dir, k, entry)

    def commit_full(
        self, k: int, units: tuple[int, int], rows: list, taken: list[Piece]
    ) -> tuple[dict, dict] | None:
        """Commit shard k from its pieces and this run's rows (all its units between them).
        Returns (entry, this run's counters), or None if another process committed it
        first (its file stands)."""
        new = self.mode.totals(rows) if rows else {}
        batches = pieces.read_pieces(self.out_dir, taken, self.layout) + [encode(rows, self.layout)]
        batch = merge(batches)
        self._check_cover(k, units, batch)
        totals = {"rows": units[1] - units[0]}
        for p in taken:
            add_totals(totals, p.entry)
        add_totals(totals, new)
        if "units" in totals:  # score mode: rows are the file's rows (one per candidate)
            totals["rows"] = batch.num_rows
        # When the shard's rows were made: its pieces' events, then this commit's new rows.
        timeline = [e for p in taken for e in p.entry.get("timeline", [])]
        new_rows = units[1] - units[0] - sum(len(p.units) for p in taken)
        if new_rows > 0:
            timeline.append(self.event(k, new_rows, new))
        self.started.pop(k, None)
        meta = {**totals, "fingerprint": self.fingerprint, "shard": k, "timeline": timeline}
        published, size, sha = publish_file(self.part_path(k), batch, self.layout, meta)
        if not published:
            self.log(f"shard {k} was committed by another process meanwhile; keeping its file")
            entry = self.recover(k)
            pieces.remove_pieces(self.out_dir, k)
            return None if entry is None else (entry, {})
        entry = {**meta, "file": os.path.basename(self.part_path(k)), "size": size, "sha256": sha}
        entry = manifest.publish_entry(self.out_dir, k, entry)
        pieces.remove_pieces(self.out_dir, k)
        return entry, new

    def _check_cover(self, k: int, units: tuple[int, int], batch: Batch) -> None:
        have = sorted(set(batch.units))
        if have != list(range(*units)):
            raise RuntimeError(
                f"shard {k}: output rows cover {len(have)} of units {units[0]}..{units[1] - 1}"
            )
        if self.layout.mode != "score" and len(batch.units) != len(have):
            raise RuntimeError(f"shard {k}: {len(batch.units)} rows for {len(have)} units")

    def commit_piece(self, k: int, rows: list) -> dict | None:
        """Commit this run's finished rows of unfinished shard k as a piece."""
        if not rows:
            return None
        fields = {**self.mode.totals(rows), "fingerprint": self.fingerprint}
        fields["timeline"] = [self.event(k, len({r.index for r in rows}), fields)]
        return pieces.commit_piece(self.out_dir, k, encode(rows, self.layout), self.layout, fields)


def _jsonl_totals(path: str) -> dict | None:
    """Counters of an openai-batch part file, read from its lines."""
    totals = {"rows": 0, "ok": 0, "errors": 0, "num_prompt_tokens": 0, "num_cached_tokens": 0}
    totals["num_generated_tokens"] = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a planted symlink is not followed
        with open(fd, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                totals["rows"] += 1
                if rec.get("error") is not None:
                    totals["errors"] += 1
                    continue
                totals["ok"] += 1
                usage = rec["response"]["body"]["usage"]
                totals["num_prompt_tokens"] += int(usage["prompt_tokens"])
                totals["num_generated_tokens"] += int(usage["completion_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return totals
