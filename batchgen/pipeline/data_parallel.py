"""Data parallel runs: one engine worker per GPU group, all pulling shards from one queue.

`run_task` is what `batchgen run` calls. With one engine (data_parallel_size 1, or auto on
one GPU or on CPU) the Runner runs the task here. With N > 1 the Runner still claims the
output directory, checks the job and makes the shard plan, once, in this process; then
WorkerPool, as its shard loop, starts N workers (dp_worker.py, each pinned to its GPUs) and:
- lets the output directory's shard locks be the queue: every worker takes the next shard no
  one has committed or locked, so no GPU idles while a shard is left;
- feeds the Runner's one progress bar and counters from the workers' reports, so the summary,
  `_stats.json` and `--strict` are the task's as from one process;
- forwards SIGTERM / SIGUSR1 / SIGINT to every worker (each commits its finished rows and
  exits 75);
- reports a worker that dies (killed, CUDA error, any exit but 0 or 75) with its GPUs and the
  shards it held. The workers' locks are this process's (locks.set_owner), so a dead worker's
  stay live until this process acts: it breaks them, and another worker retries the shard; a
  shard that two failed workers held is set aside instead: its lock is taken over (one rename,
  what: "set aside") so the other workers leave it, and the run, once the other shards are
  done, exits non-zero naming it. Committed shards and pieces are never lost.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from batchgen.io import locks, manifest
from batchgen.job import JobSpec
from batchgen.pipeline.dp_placement import (
    Placement,
    cuda_visible,
    place_workers,
    visible_gpus,
    worker_job,
)
from batchgen.pipeline.dp_worker import SET_ASIDE, WorkerSetup, main
from batchgen.pipeline.exit_codes import EX_IOERR, EX_SOFTWARE, EXIT_BAD_JOB
from batchgen.pipeline.runner import Runner, RunResult

_SHARD_LOCK = re.compile(r"part-(\d+)\.lock$")
POLL_S = 0.2  # how often the stop flag is looked at while waiting on the workers
ABORT_WAIT_S = 10.0  # after a second Ctrl-C, how long workers get before they are killed
_WORKER_ARGS = ("grace_s", "checkpoint_s", "lease_s", "max_in_flight", "chunk_rows")


def run_task(job: JobSpec, **runner_args: Any) -> RunResult:
    """Run this task of `job` with as many engines as model.data_parallel_size gives.

    Raises:
        JobError: before any row is read, if more GPUs are asked for than visible.
    """
    placements = place_workers(job, visible_gpus())
    if len(placements) == 1:
        return Runner(job, **runner_args).run()
    pool = WorkerPool(placements, runner_args)
    return Runner(job, shard_loop=pool.run, **runner_args).run()


@dataclass
class Worker:
    placement: Placement
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection | None  # None once the pipe is closed
    ready: bool = False  # it said hello: stop signals are sent from then on
    done: int | None = None  # its run's exit code, when it ended normally
    error: tuple[int, str] | None = None  # (exit code, message) it reported
    ended: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def name(self) -> str:
        return f"worker {self.placement.index} ({self.placement.label}, pid {self.pid})"

    def outcome(self) -> str:
        code = self.process.exitcode
        if self.error is not None:
            return f"failed (exit {self.error[0]}): {self.error[1]}"
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"ended with exit code {code}"


class WorkerPool:
    """Runner's shard loop over N worker processes (see the module docstring)."""

    def __init__(self, placements: list[Placement], runner_args: dict[str, Any]):
        self.placements = placements
        self.args = runner_args
        self.workers: list[Worker] = []
        self.failures: dict[int, list[str]] = {}  # shard -> what ended each worker holding it
        self.set_aside: dict[int, locks.HeldLock] = {}
        self.forwarded: str | None = None  # the stop signal sent to the workers

    # ------------------------------------------------------------------------------ the loop

    def run(self, runner: Runner, todo: list[int]) -> bool:
        self.r = runner
        if not todo or runner.stop.is_set():
            return not todo
        self.log = runner.log
        labels = ", ".join(p.label for p in self.placements)
        self.log(f"data parallel: {len(self.placements)} engine workers ({labels})")
        try:
            self._start()
            while not all(w.ended for w in self.workers):
                self._forward_stop()
                self._wait()
        except BaseException:
            self._abort()
            raise
        return self._settle(todo)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked threads
        size = len(self.placements)
        options = {k: self.args[k] for k in _WORKER_ARGS if k in self.args}
        options["template_limits"] = self.args.get("template_limits")
        for p in self.placements:
            setup = WorkerSetup(
                p.index,
                size,
                worker_job(self.r.job, p, size),
                self.r.shard,
                os.getpid(),
                self.args.get("holder", ""),
                options,
                self.args.get("engine_factory"),
                self.args.get("tokenizer_factory"),
            )
            ours, theirs = context.Pipe(duplex=False)
            process = context.Process(
                target=main, args=(setup, theirs), name=f"batchgen-dp-{p.index}"
            )
            with cuda_visible(p.gpus):
                process.start()
            theirs.close()
            self.workers.append(Worker(p, process, ours))

    def _wait(self) -> None:
        live = [w for w in self.workers if not w.ended]
        handles = {w.process.sentinel: w for w in live}
        handles.update({w.conn: w for w in live if w.conn is not None})
        for ready in wait(list(handles), timeout=POLL_S):
            w = handles[ready]
            self._drain(w)
            if ready == w.process.sentinel:
                w.process.join()
                self._drain(w)
                w.ended = True
                self._ended(w)

    def _drain(self, w: Worker) -> None:
        """Handle every message waiting in w's pipe."""
        try:
            while w.conn is not None and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            w.conn.close()
            w.conn = None

    def _handle(self, w: Worker, msg: tuple) -> None:
        kind, r = msg[0], self.r
        if kind == "hello":
            w.ready = True
            self.log(f"data parallel: {w.name} started")
            if self.forwarded:
                _signal(w.pid, self.forwarded)
        elif kind == "log":
            self.log(f"[worker {w.placement.index}] {msg[1]}")
        elif kind == "progress":
            r.progress.update(msg[1], msg[2])
        elif kind == "committed":
            r.note_committed(msg[1], msg[2], msg[3])
        elif kind == "piece":
            r.note_piece(msg[1], msg[2], [])
        elif kind == "done":
            w.done = msg[1]
        elif kind == "error":
            w.error = (msg[1], msg[2])

    # ---------------------------------------------------------------------------- stopping

    def _forward_stop(self) -> None:
        """Send the stop signal this process caught to every started worker, once."""
        if not self.r.stop.is_set() or self.forwarded:
            return
        name = self.r.stop.signal_name
        self.forwarded = name if name in ("SIGTERM", "SIGUSR1", "SIGINT") else "SIGTERM"
        for w in self.workers:
            if w.ready and not w.ended:
                _signal(w.pid, self.forwarded)

    def _abort(self) -> None:
        """Leaving on an exception (a second Ctrl-C included): every worker gets a second
        SIGINT (it stops at once) and is killed if still there after ABORT_WAIT_S."""
        for w in self.workers:
            if w.ready and w.process.is_alive():
                _signal(w.pid, "SIGINT")
        for w in self.workers:
            w.process.join(ABORT_WAIT_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            for info in self._locks_of(w).values():
                _break(info)

    # ------------------------------------------------------------------------------ failures

    def _locks_of(self, w: Worker) -> dict[str, locks.LockInfo]:
        """The lock files an ended worker left (its run lock; its unfinished shards' locks
        after a death or an error), by name."""
        return {
            info.name: info
            for info in locks.list_locks(self.r.out_dir, self.r.keeper.lease_s)
            if info.holder.get("host") == locks.HOST and info.holder.get("pid") == w.pid
        }

    def _ended(self, w: Worker) -> None:
        """Account for a worker that ended: a failure charges the shards it left unfinished,
        each then retried (its lock broken) or, at its second failure, set aside."""
        left = self._locks_of(w)
        shards = {int(m.group(1)): left.pop(n) for n in list(left) if (m := _SHARD_LOCK.match(n))}
        for info in left.values():
            _break(info)
        code = w.process.exitcode
        if code == 0 or (w.done is not None and code == w.done):
            if w.done not in (None, 0) and not self.r.stop.is_set():
                self.log(f"data parallel: {w.name} stopped (exit {w.done}); its shards go on")
            lost = []
        else:
            lost = sorted(k for k in shards if not self.r.committed_by_entry(k))
            holding = f" while holding shard(s) {', '.join(map(str, lost))}" if lost else ""
            self.log(f"data parallel: {w.name} {w.outcome()}{holding}")
        for k, info in shards.items():
            if k in lost:
                self.failures.setdefault(k, []).append(f"{w.name} {w.outcome()}")
            if len(self.failures.get(k, ())) < 2 or k not in lost:
                _break(info)
                if k in lost:
                    self.log(f"data parallel: shard {k} goes back to the queue for another worker")
                continue
            # The worker's lock stays live (this process owns it) until replaced: no other
            # worker can take the shard in between.
            self.set_aside[k] = held = locks.take_over(info, SET_ASIDE, self.r.task)
            self.r.keeper.add(held)
            self.log(f"data parallel: shard {k} failed twice; it is set aside for this run")

    def _settle(self, todo: list[int]) -> bool:
        """Whether every shard of `todo` is committed; if not, without a stop signal, why
        (Runner.failure: the exit code and a line naming the shards)."""
        r = self.r
        committed = manifest.committed_shards(r.out_dir, r.fingerprint, r.shard.owns)
        r.own_entries.update(committed)
        missing = [k for k in todo if k not in committed]
        if not missing or r.stop.is_set():
            return not missing
        codes = [w.error[0] for w in self.workers if w.error is not None]
        code = next((c for c in codes if c in (EXIT_BAD_JOB, EX_IOERR)), EX_SOFTWARE)
        failed = [k for k in missing if len(self.failures.get(k, ())) >= 2]
        if failed:
            why = "; ".join(f"shard {k}: {' / '.join(self.failures[k])}" for k in failed)
            message = f"shard(s) {', '.join(map(str, failed))} failed twice ({why})"
        else:
            ends = "; ".join(f"{w.name} {w.outcome()}" for w in self.workers if w.done is None)
            message = f"no engine worker is left ({ends or 'all ended'})"
        r.failure = (
            code,
            f"error: {message}; {len(missing)} shard(s) of this task are not committed; "
            "committed shards are kept: run the same command again to retry them",
        )
        return False


def _break(info: locks.LockInfo) -> None:
    """Remove a lock an ended worker left (waiting out another breaker at it)."""
    for _ in range(1000):
        if locks.break_stale(info):
            return
        time.sleep(0.01)


def _signal(pid: int, name: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, getattr(signal, name))
