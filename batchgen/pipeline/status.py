"""`batchgen status OUT_DIR`: shards done, partial shards, who holds which lock, totals."""

from __future__ import annotations

import os
import time

from batchgen.io import locks, manifest, pieces
from batchgen.io.arrow_types import MIXED
from batchgen.io.shard_plan import read_plan
from batchgen.job import JobError
from batchgen.pipeline.stats import job_totals, last_run_line


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def status_lines(out_dir: str) -> list[str]:
    job = manifest.read_job(out_dir)
    if job is None:
        raise JobError(f"{out_dir}: no batchgen output here (no {manifest.JOB_FILE})")
    fp = job["fingerprint"]
    entries = manifest.read_entries(out_dir)
    entries = {k: e for k, e in entries.items() if e.get("fingerprint") == fp}
    totals = job_totals(entries)
    plan = read_plan(out_dir)
    # The plan knows the shard count from the moment it is written (before any shard is done);
    # _job.json records it too once a run has read the plan.
    total = plan.num_shards if plan is not None else job.get("num_shards")
    done = os.path.exists(os.path.join(out_dir, manifest.SUCCESS_FILE))
    lines = [
        f"{out_dir}: {'complete' if done else 'in progress'}",
        f"shards: {totals['shards']}/{total if total is not None else '?'} committed",
        f"rows: {totals['ok']} ok, {totals['errors']} error(s)",
        f"tokens: {totals['num_prompt_tokens']} prompt ({totals['num_cached_tokens']} cached), "
        f"{totals['num_generated_tokens']} generated",
    ]
    partial = {k: p for k, p in pieces.list_pieces(out_dir, fp).items() if k not in entries}
    if partial:
        held = sum(len(pieces.usable(p)[1]) for p in partial.values())
        lines.append(
            f"partial: {held} finished row(s) of {len(partial)} unfinished shard(s) kept in "
            f"{sum(len(p) for p in partial.values())} piece(s) ({pieces.PARTIAL_DIR}/)"
        )
    if plan is not None:
        mixed = [c for c, t in plan.columns.items() if t == MIXED]
        lines.append(
            f"plan: {plan.num_units} rows in {plan.num_shards} shard(s), "
            f"{len(plan.duplicates)} duplicate id(s)"
            + (f"; written as text (mixed kinds): {', '.join(mixed)}" if mixed else "")
        )
    lines += _lock_lines(out_dir)
    last = (manifest.read_stats(out_dir) or {}).get("last_run")
    try:
        lines.append(last_run_line(last))
    except (TypeError, KeyError, ValueError):
        pass  # no run has finished yet, or a file this version does not read
    return lines


def _lock_lines(out_dir: str) -> list[str]:
    """In progress: which process works on which shard (and runs, plans); stale locks."""
    found = locks.list_locks(out_dir)
    shards = [i for i in found if i.name.startswith("part-")]
    runs = [i for i in found if i.name.startswith("run-")]
    lines = []
    live = [i for i in shards if i.live]
    if live:
        lines.append(f"in progress: {len(live)} shard(s)")
        for info in live:
            since = info.holder.get("since", info.mtime)
            lines.append(
                f"  {info.name.removesuffix('.lock')}: {info.who()}, since {_ago(since)}, "
                f"lease renewed {_ago(info.mtime)}"
            )
    stale = [i for i in shards if not i.live]
    if stale:
        names = ", ".join(i.name.removesuffix(".lock") for i in stale)
        lines.append(f"stale locks (holder gone; the next run takes them over): {names}")
    live_runs = [i for i in runs if i.live]
    if live_runs:
        who = [f"{i.who()} (since {_ago(i.holder.get('since', 0))})" for i in live_runs]
        lines.append("runs: " + "; ".join(who))
    if any(i.name == "_plan.lock" and i.live for i in found):
        planner = next(i for i in found if i.name == "_plan.lock")
        lines.append(f"planning: {planner.who()}")
    return lines
