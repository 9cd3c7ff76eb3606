"""Run statistics: token and row counters, the final summary and `_stats.json`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from batchgen.io import manifest
from batchgen.pipeline.sharding import ShardSelector


@dataclass
class RunStats:
    """Counters of one run (this process), plus the job-wide totals from the manifest."""

    rows_ok: int = 0
    rows_error: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    shards_committed: int = 0
    shards_skipped: int = 0
    pieces_committed: int = 0  # partial shards committed on a stop
    wall_s: float = 0.0

    def add_rows(self, totals: dict) -> None:
        """Counters of rows this run generated (a shard's new rows, or a piece's)."""
        self.rows_ok += totals.get("ok", 0)
        self.rows_error += totals.get("errors", 0)
        self.num_prompt_tokens += totals.get("num_prompt_tokens", 0)
        self.num_cached_tokens += totals.get("num_cached_tokens", 0)
        self.num_generated_tokens += totals.get("num_generated_tokens", 0)

    def add_shard(self, entry: dict) -> None:
        self.add_rows(entry)
        self.shards_committed += 1

    @property
    def did_nothing(self) -> bool:
        """No row generated and nothing committed: every owned shard was done already (or the
        run stopped before any row finished)."""
        return not (
            self.rows_ok or self.rows_error or self.shards_committed or self.pieces_committed
        )

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "cache_hit_rate": self.cache_hit_rate,
        }


def job_totals(entries: dict[int, dict]) -> dict:
    """Sums over committed shard entries (the whole job, all tasks and runs)."""
    keys = (
        "rows",
        "ok",
        "errors",
        "num_prompt_tokens",
        "num_cached_tokens",
        "num_generated_tokens",
    )
    totals = {k: sum(int(e.get(k, 0)) for e in entries.values()) for k in keys}
    totals["shards"] = len(entries)
    p = totals["num_prompt_tokens"]
    totals["cache_hit_rate"] = totals["num_cached_tokens"] / p if p else 0.0
    return totals


def write_stats(
    out_dir: str,
    run: RunStats,
    read_entries: Callable[[], dict[int, dict]],
    task: str,
    fingerprint: str | None = None,
) -> dict:
    """Write `_stats.json`: job totals over committed shards plus the last real run's counters.

    A run that did nothing (a rerun finding every shard committed) keeps the `last_run` of the
    same job (`fingerprint`; a file from before the fingerprint was recorded counts as the
    same, as --overwrite removes another job's) as it was, rather than replace it with zeros.

    Slurm tasks that finish together each write the file, and the last write wins. A task that
    read the committed shards just before another task's final commit would leave totals
    without that shard, so the shards are read again after each write, and the file written
    again while they changed. The last writer's final read then follows every commit whose
    task wrote before it. Returns what was written last.
    """
    last = {**run.to_dict(), "task": task}
    if run.did_nothing:
        before = manifest.read_stats(out_dir) or {}
        same = before.get("fingerprint") in (None, fingerprint)
        if same and isinstance(before.get("last_run"), dict):
            last = before["last_run"]
    entries = read_entries()
    while True:
        stats = {"job": job_totals(entries), "last_run": last, "fingerprint": fingerprint}
        manifest.write_json(os.path.join(out_dir, manifest.STATS_FILE), stats)
        latest = read_entries()
        if latest.keys() == entries.keys():
            return stats
        entries = latest


def last_run_line(last: dict) -> str:
    """The `last_run` of `_stats.json` in one line."""
    return (
        f"last run (task {last['task']}): {last['rows_ok'] + last['rows_error']} rows in "
        f"{last['wall_s']:.1f} s, {last['tokens_per_s']:.1f} generated tok/s"
    )


def summary_lines(
    run: RunStats,
    task: dict,
    job: dict,
    num_shards: int | None,
    shard: ShardSelector,
    last_run: dict | None = None,
) -> list[str]:
    """The end-of-run summary. Shards, rows and tokens are the task's own shards' (over every
    run of the task); a task of several adds one line of the job's totals so far, which the
    task that completes the job prints complete.

    Args:
        run: this run's counters.
        task / job: job_totals of the task's committed shards / of every committed shard.
        num_shards: the job's shard count (None when the input was not read to the end).
        shard: which shards the task owns.
        last_run: for a finished run that had nothing to do, `_stats.json`'s last real run,
            shown instead of this run's zeros.
    """
    of = shard.task_label()
    owned = shard.num_owned(num_shards) if num_shards is not None else "?"
    lines = [
        f"shards committed: {task['shards']}/{owned}{of} (this run: {run.shards_committed}, "
        f"already done: {run.shards_skipped})",
        f"rows{of}: {task['ok']} ok, {task['errors']} error(s)",
        f"tokens{of}: {task['num_prompt_tokens']} prompt ({task['num_cached_tokens']} cached, "
        f"hit rate {task['cache_hit_rate']:.1%}), {task['num_generated_tokens']} generated",
    ]
    if last_run is None:
        lines.append(
            f"this run: {run.rows_ok + run.rows_error} rows in {run.wall_s:.1f} s, "
            f"{run.tokens_per_s:.1f} generated tok/s"
        )
    else:
        lines.append(f"nothing to do: every shard{of} was already committed")
        if last_run.get("rows_ok", 0) + last_run.get("rows_error", 0):
            lines.append(last_run_line(last_run))
    if run.pieces_committed:
        lines.append(
            f"partial: {run.pieces_committed} unfinished shard(s) keep their finished rows as "
            "pieces (in _partial/) until a resumed run completes them"
        )
    if shard.count > 1:
        total = num_shards if num_shards is not None else "?"
        lines.append(
            f"job (all tasks): {job['shards']}/{total} shards committed, rows: {job['ok']} ok, "
            f"{job['errors']} error(s)"
        )
    return lines
