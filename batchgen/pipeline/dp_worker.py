"""A data parallel worker process: one engine running the task's shards no other worker holds.

The parent (data_parallel.py) starts it with multiprocessing's spawn, pinned to its GPUs by
CUDA_VISIBLE_DEVICES, and reads what it reports over a one-way pipe:
  ("hello", pid)                 its stop-signal handlers are in place; signals may come
  ("log", text)                  a line of its log
  ("progress", rows, tokens)     rows and generated tokens finished since the last report
  ("committed", k, entry, new)   it committed shard k (new: this run's counters, or None)
  ("piece", k, entry)            it committed finished rows of shard k as a piece
  ("done", code) / ("error", code, message)   how it ended (then it exits with that code)
It runs the ordinary Runner and ShardLoop: the shard locks in `_locks/` are the queue, so each
worker takes the next shard that is neither committed nor locked. Its locks are owned by the
parent (locks.set_owner): a worker that dies, or fails with an error, leaves the locks of its
unfinished shards live for the parent to hand on or set aside. It sits in its own process
group (a terminal's Ctrl-C reaches the parent only, which forwards it once) and stops, like on
SIGTERM, if the parent goes away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from batchgen.io import locks
from batchgen.job import JobError, JobSpec
from batchgen.pipeline.exit_codes import EXIT_ABORTED, EXIT_BAD_JOB, describe_failure
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.signals import STOP_SIGNALS, StopFlag

PROGRESS_EVERY_S = 0.2  # progress is batched: at most this often one message
PARENT_POLL_S = 1.0
SET_ASIDE = "set aside"  # the `what` of the lock a parent holds on a shard that failed twice


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs; pickled to the spawned process."""

    index: int
    size: int
    job: JobSpec  # one engine on the worker's own devices (dp_placement.worker_job)
    shard: ShardSelector
    parent_pid: int
    holder: str = ""  # the run's lock note (the Slurm job)
    options: dict[str, Any] = field(default_factory=dict)  # more Runner keyword arguments
    engine_factory: Callable | None = None  # None: the real engine (tests pass fakes)
    tokenizer_factory: Callable | None = None

    @property
    def family(self) -> str:
        """The tail of every worker's lock note: whose worker it is."""
        return f"parent pid {self.parent_pid}"


class Link:
    """The pipe to the parent; a parent gone makes sends no-ops."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._guard = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._guard, contextlib.suppress(OSError):
            self.conn.send(message)


class PipeProgress:
    """The Runner's progress object in a worker: counts go to the parent's one bar."""

    def __init__(self, link: Link):
        self.link = link
        self.rows = self.tokens = 0
        self.sent_at = time.monotonic()

    def update(self, rows: int, generated_tokens: int) -> None:
        self.rows += rows
        self.tokens += generated_tokens
        if time.monotonic() - self.sent_at >= PROGRESS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.rows or self.tokens:
            self.link.send(("progress", self.rows, self.tokens))
        self.rows = self.tokens = 0
        self.sent_at = time.monotonic()

    def set_total(self, total: int) -> None:
        pass  # the parent's bar knows the task's total

    def close(self) -> None:
        self.flush()


class WorkerRunner(Runner):
    """A Runner that reports its shards, rows and log lines to the parent."""

    def __init__(self, setup: WorkerSetup, link: Link, stop: StopFlag):
        note = f"{setup.holder} " if setup.holder else ""
        super().__init__(
            setup.job,
            shard=setup.shard,
            engine_factory=setup.engine_factory,
            tokenizer_factory=setup.tokenizer_factory,
            stop=stop,
            log=lambda text: link.send(("log", text)),
            holder=f"{note}worker {setup.index}/{setup.size}, {setup.family}",
            **setup.options,
        )
        self.setup, self.link = setup, link

    def make_progress(self, total: int) -> PipeProgress:
        return PipeProgress(self.link)

    def abandon_lock(self, lock: locks.HeldLock) -> None:
        self.keeper.forget(lock)  # the parent breaks it or sets the shard aside

    def note_committed(self, k: int, entry: dict | None = None, new: dict | None = None) -> None:
        super().note_committed(k, entry, new)
        if new is not None:  # committed here (else found committed, counted where it was)
            self.link.send(("committed", k, self.own_entries[k], new))

    def note_piece(self, k: int, entry: dict, rows: list) -> None:
        super().note_piece(k, entry, rows)
        self.link.send(("piece", k, entry))

    def _sibling(self, info: locks.LockInfo) -> bool:
        h = info.holder
        return h.get("host") == locks.HOST and str(h.get("task", "")).endswith(self.setup.family)

    def note_blocked(self, k: int, info: locks.LockInfo) -> None:
        if not self._sibling(info):  # another worker's shard is the ordinary case
            super().note_blocked(k, info)

    def leave_to_holder(self, info: locks.LockInfo) -> bool:
        h = info.holder
        mine = h.get("host") == locks.HOST and h.get("pid") == self.setup.parent_pid
        return mine and h.get("what") == SET_ASIDE


def _catch_stop_signals(stop: StopFlag) -> None:
    """Stop signals set the flag from the start (the Runner installs its own handlers, with
    the same flag, while it runs)."""

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if stop.is_set() and name == "SIGINT":
            raise KeyboardInterrupt
        stop.set(name)

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), handle)


def _watch_parent(parent_pid: int, stop: StopFlag) -> None:
    """A parent that is gone (killed) cannot aggregate: stop as on SIGTERM, committing every
    finished row, so a rerun resumes."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        stop.set("parent exit")

    threading.Thread(target=watch, name="batchgen-dp-parent", daemon=True).start()


def main(setup: WorkerSetup, conn: Connection) -> None:
    """The worker process's entry (multiprocessing target); exits with the run's exit code."""
    os.setpgrp()  # Ctrl-C in a terminal reaches the parent alone; it forwards it once
    locks.set_owner(setup.parent_pid)
    stop = StopFlag()
    _catch_stop_signals(stop)
    link = Link(conn)
    link.send(("hello", os.getpid()))
    _watch_parent(setup.parent_pid, stop)
    code = 0
    try:
        code = WorkerRunner(setup, link, stop).run().exit_code
        link.send(("done", code))
    except JobError as e:
        code = EXIT_BAD_JOB
        link.send(("error", code, str(e)))
    except KeyboardInterrupt:
        code = EXIT_ABORTED
        link.send(("error", code, "interrupted twice: stopped at once"))
    except Exception as e:  # reported to the parent, which decides the run's exit code
        code, message = describe_failure(e)
        link.send(("error", code, message))
    finally:
        conn.close()
    sys.exit(code)
