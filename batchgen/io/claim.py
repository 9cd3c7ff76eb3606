"""Claiming an output directory for one job, safely against runs started at the same moment.

Every run first takes a run lock (`_locks/run-HOST-PID-TOKEN.lock`, held until it exits), then,
under the claim mutex (`_locks/_claim.lock`, held for milliseconds), reads `_job.json`:
- absent: the run creates it (link(): only one creator can win) and proceeds;
- the same job (fingerprint): it proceeds (shard locks keep the runs apart);
- a different job: refused while any other live process holds a lock here (a run of that job
  is in progress) or, unless --overwrite, while any of its results are committed; otherwise
  (its runs all ended and it committed nothing, e.g. its model failed to load) the claim is
  replaced.
Decisions are serialized by the mutex and every run that proceeded holds its run lock, so of
two different jobs started together exactly one proceeds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from batchgen.io import atomic, locks, manifest
from batchgen.job import JobError

MUTEX = "_claim.lock"
MUTEX_WAIT_S = 60.0  # the mutex is held for milliseconds; this long means a holder is stuck


def claim_output(
    out_dir: str,
    record: dict,
    overwrite: bool,
    lease_s: float = locks.DEFAULT_LEASE_S,
    task: str = "",
    log: Callable[[str], None] = lambda m: None,
) -> locks.HeldLock:
    """Claim `out_dir` for the job `record` (fingerprint, parts, ...); returns the run lock,
    which the caller releases when the run ends. Raises JobError if the directory is not this
    job's to write."""
    os.makedirs(out_dir, exist_ok=True)
    manifest.check_no_links(out_dir)  # before anything in it is read, written or cleared
    name = f"run-{locks.HOST}-{os.getpid()}-{os.urandom(4).hex()}.lock"
    run = locks.try_acquire(locks.lock_path(out_dir, name), "run", lease_s, task)
    assert isinstance(run, locks.HeldLock)  # a unique name: nobody else holds it
    try:
        with _mutex(out_dir, lease_s, task):
            _decide(out_dir, record, overwrite, lease_s, run, log)
    except BaseException:
        run.release()
        raise
    return run


class _mutex:
    def __init__(self, out_dir: str, lease_s: float, task: str):
        self.path = locks.lock_path(out_dir, MUTEX)
        self.lease_s, self.task = lease_s, task
        self.lock: locks.HeldLock | None = None

    def __enter__(self) -> None:
        deadline = time.monotonic() + MUTEX_WAIT_S
        while True:
            got = locks.try_acquire(self.path, "claim", self.lease_s, self.task)
            if isinstance(got, locks.HeldLock):
                self.lock = got
                return
            if time.monotonic() > deadline:
                raise JobError(
                    f"output.path: the claim lock {self.path} has been held by {got.who()} "
                    f"for over {MUTEX_WAIT_S:.0f} s; if that process is gone, remove the file"
                )
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()


def _decide(
    out: str,
    record: dict,
    overwrite: bool,
    lease_s: float,
    run: locks.HeldLock,
    log: Callable[[str], None],
) -> None:
    if manifest.foreign_names(out) and not manifest.is_batchgen_dir(out):
        if not overwrite:
            raise JobError(
                f"output.path: {out!r} is not empty and holds no batchgen output; choose "
                "an empty or new directory, or pass --overwrite"
            )
        manifest.clear_outputs(out)
    path = os.path.join(out, manifest.JOB_FILE)
    data = manifest.json_bytes(record)
    if atomic.publish_bytes(path, data):
        return
    old = manifest.read_job(out) or {}
    if old.get("fingerprint") == record["fingerprint"]:
        return
    parts = old.get("parts", {})
    changed = [k for k, v in record["parts"].items() if parts.get(k) != v] or ["unknown"]
    what = f"changed: {', '.join(changed)}"
    others = [
        info
        for info in locks.list_locks(out, lease_s)
        if info.live and info.path not in (run.path, locks.lock_path(out, MUTEX))
    ]
    if others:
        since = time.strftime("%H:%M:%S", time.localtime(others[0].holder.get("since", 0)))
        raise JobError(
            f"output.path: {out!r} is being written by a run of a different job ({what}; "
            f"{others[0].who()}, since {since}); wait for it to end, or use another output.path"
        )
    if manifest.has_results(out):
        if not overwrite:
            raise JobError(
                f"output.path: {out!r} holds results of a different job ({what}); pass "
                "--overwrite to discard them, or use another output.path"
            )
        log(f"--overwrite: discarding old outputs in {out} ({what})")
    else:
        log(f"{out}: a different job ({what}) claimed this directory but committed nothing; "
            "claiming it for this job")  # fmt: skip
    manifest.clear_outputs(out)
    manifest.write_json(path, record)
