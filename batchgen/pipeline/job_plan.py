"""The job's shard plan: read it from the output directory, or make it once for every task.

The first task to need a plan takes the plan lock (`_locks/_plan.lock`), scans the input and
writes `_plan.json`; tasks starting meanwhile wait for that file instead of scanning too, and
take over if the planner dies. A plan made for another input or other reading settings (its
key differs) is made again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.io import locks
from batchgen.io.parquet_schema import arrow_schema
from batchgen.io.rows import Position
from batchgen.io.scan import LineSpec, ScanStopped, scan
from batchgen.io.shard_plan import ShardPlan, plan_key, read_plan, write_plan
from batchgen.job import JobSpec
from batchgen.pipeline.modes import mode_for
from batchgen.pipeline.signals import StopFlag

PLAN_LOCK = "_plan.lock"
POLL_S = 0.2


class Stopped(Exception):
    """A stop signal came while waiting for another task's plan."""


@dataclass(frozen=True)
class UnitReader:
    """The job's units from a position, without de-duplication (the plan finds duplicates);
    picklable, so worker processes can scan byte ranges with it."""

    job: JobSpec
    files: list[str]
    columns: list[str]

    def __call__(self, start: Position | None, first_index: int, limit: int | None):
        return mode_for(self.job).reader(
            self.files, self.columns, start=start, first_index=first_index, limit=limit,
            dedup=False,
        )  # fmt: skip


def default_workers() -> int:
    """Processes to scan with: the CPUs this process may use (a Slurm task's share), at
    most 16."""
    try:
        return max(1, min(16, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(16, os.cpu_count() or 1))


def plan_settings(job: JobSpec, mode, input_fingerprint: str) -> dict:
    """What the plan depends on: the input (its fingerprint) and how units are read."""
    return {
        "input": input_fingerprint,
        "id_column": job.input.id_column,
        "format": job.input.format,
        "units": mode.unit_kind(),
        "shard_rows": job.output.shard_rows,
        "passthrough": list(job.input.columns),
        "max_row_bytes": job.input.max_row_bytes,  # which rows are row_too_large records
    }


def ensure_plan(
    job: JobSpec,
    mode,
    files: list[str],
    formats: list[str],
    columns: list[str],
    input_fingerprint: str,
    stop: StopFlag,
    keeper: locks.LeaseKeeper,
    task: str = "",
    log: Callable[[str], None] = lambda m: None,
    workers: int = 1,
) -> ShardPlan:
    """The plan in the output directory for this input, made now if there is none (the plan
    lock's lease is renewed by `keeper` while the scan runs)."""
    lease_s = keeper.lease_s
    out = job.output.path
    settings = plan_settings(job, mode, input_fingerprint)
    key = plan_key(**settings)
    lock_file = locks.lock_path(out, PLAN_LOCK)
    waited = False
    while True:
        plan = read_plan(out, key)
        if plan is not None:
            return plan
        got = locks.try_acquire(lock_file, "plan", lease_s, task)
        if isinstance(got, locks.HeldLock):
            keeper.add(got)
            break
        if not waited:
            log(f"waiting for the shard plan being made by {got.who()}")
            waited = True
        if stop.is_set():
            raise Stopped
        time.sleep(POLL_S)
    try:
        plan = read_plan(out, key)  # written between our last look and the lock
        if plan is not None:
            return plan

        lines = LineSpec(job.input.id_column, job.input.max_row_bytes)
        try:
            plan = scan(
                UnitReader(job, files, columns),
                files,
                formats,
                list(job.input.columns),
                arrow_schema,
                job.output.shard_rows,
                key,
                settings,
                log,
                workers=workers,
                lines=lines if mode.unit_kind() == "rows" else None,
                stopped=stop.is_set,
            )
        except ScanStopped:
            raise Stopped from None
        write_plan(out, plan)
        return plan
    finally:
        keeper.release(got)
