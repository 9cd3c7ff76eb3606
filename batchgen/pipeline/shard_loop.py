"""The run loop: lock a shard, read its rows, feed the engine, commit; on a stop, commit pieces.

Shards are opened in order while fewer than max_in_flight requests wait: the shard's lock is
taken (a shard another live process holds is skipped and looked at again later), its rows
are read straight from the shard plan's position, the rows that committed pieces already hold
are dropped, and the rest planned into requests. A shard whose last request finishes is
committed whole (its pieces merged in). Every `checkpoint_s` the finished rows of unfinished
shards are committed as pieces, so even a SIGKILL loses at most that much work. On a stop
signal nothing more is admitted; requests in the engine may finish for up to the grace
period, then every finished row of an unfinished shard is committed as a piece and the locks
are released.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from batchgen.io import atomic, locks, pieces
from batchgen.io.pieces import Piece
from batchgen.plan.planner import Request
from batchgen.plan.prompts import RenderStopped

BLOCKED_POLL_S = 0.5  # how often a shard held by another live process is looked at again


@dataclass
class OpenShard:
    k: int
    lock: locks.HeldLock
    units: tuple[int, int]  # the shard's [first, stop) unit indexes
    taken: list[Piece]  # committed pieces this shard builds on
    results: list = field(default_factory=list)  # rows finished in this run
    pending: int = 0  # requests not finished yet


class ShardLoop:
    """Processes a runner's remaining shards (see module docstring); `run` says if all done."""

    def __init__(self, runner, todo: list[int]):
        self.r = runner
        self.todo: deque[int] = deque(todo)
        self.blocked: dict[int, locks.LockInfo] = {}
        self.open: dict[int, OpenShard] = {}
        self.queue: deque[tuple[int, Request]] = deque()
        self.in_flight: dict[str, tuple[int, Request]] = {}
        self.finished_at_stop: int | None = None  # rows finished when the stop came
        self.next_checkpoint = time.monotonic() + (runner.checkpoint_s or float("inf"))

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> bool:
        r = self.r
        deadline = None
        graceful = False
        try:
            while True:
                if r.stop.is_set() and deadline is None:
                    deadline = self._begin_stop()
                if deadline is None:
                    self._fill()
                    self._admit()
                if not self.in_flight:
                    if deadline is not None:
                        break
                    if self.todo or self.queue:
                        continue
                    if self.blocked:
                        self._wait_for_blocked()
                        continue
                    break
                self._step()
                if deadline is None and time.monotonic() >= self.next_checkpoint:
                    self._checkpoint()
                if deadline is not None and time.monotonic() > deadline:
                    r.log(f"grace period over: {len(self.in_flight)} request(s) left unfinished")
                    break
            graceful = True
        finally:
            self._close(commit=graceful)
        return not (self.todo or self.blocked or self.open)

    def _begin_stop(self) -> float:
        r = self.r
        self.finished_at_stop = r.stop.rows_done_at_stop
        r.log(
            f"{r.stop.signal_name}: no new rows; {len(self.in_flight)} request(s) in the engine "
            f"may finish for up to {r.grace_s:g} s, then every finished row is committed"
        )
        self.queue.clear()
        return time.monotonic() + r.grace_s

    def _fill(self) -> None:
        while self.todo and len(self.queue) < self.r.max_in_flight and not self.r.stop.is_set():
            self._open_shard(self.todo.popleft())

    def _admit(self) -> None:
        while self.queue and len(self.in_flight) < self.r.max_in_flight:
            k, req = self.queue.popleft()
            rid = f"{k}/{req.index}"
            self.in_flight[rid] = (k, req)
            self.r.mode.submit(self.r.engine, rid, req)

    def _step(self) -> None:
        for out in self.r.engine.step():
            k, req = self.in_flight.pop(out.request_id)
            shard = self.open[k]
            rows = self.r.mode.results(req, out)
            shard.results += rows
            shard.pending -= 1
            self.r.stop.rows_done += 1
            self.r.progress.update(1, self.r.mode.totals(rows)["num_generated_tokens"])
            if shard.pending == 0:
                self._commit(k)

    # ------------------------------------------------------------------------------- shards

    def _open_shard(self, k: int) -> None:
        r = self.r
        got = locks.try_acquire(r.lock_file(k), "shard", r.keeper.lease_s, r.task)
        if isinstance(got, locks.LockInfo):
            if r.leave_to_holder(got):
                return
            if k not in self.blocked:
                r.note_blocked(k, got)
            self.blocked[k] = got
            return
        r.keeper.add(got)
        r.remove_temps_of(k)
        if r.committer.recover(k) is not None:
            r.keeper.release(got)
            r.note_committed(k)
            return
        units = r.plan.shard_units(k)
        taken, done = pieces.usable(pieces.list_pieces(r.out_dir, r.fingerprint).get(k, []))
        rows = [u for u in r.read_shard(k) if u.index not in done]
        shard = self.open[k] = OpenShard(k, got, units, taken)
        if done:
            r.log(f"shard {k}: {len(done)} row(s) already committed in piece(s), {len(rows)} to go")
        try:
            plan = r.planner().plan(rows) if rows else None
        except RenderStopped:  # a stop killed the chat template mid-shard: the shard is owed
            del self.open[k]
            r.keeper.release(got)
            self.todo.appendleft(k)
            return
        if plan is not None:
            shard.results += plan.errors
            shard.pending = len(plan.requests)
            errors = len({e.index for e in plan.errors})
            r.stop.rows_done += errors
            r.progress.update(errors, 0)
            self.queue.extend((k, req) for req in plan.requests)
        if shard.pending == 0:
            self._commit(k)

    def _commit(self, k: int) -> None:
        shard = self.open.pop(k)
        r = self.r
        try:
            try:
                done = r.committer.commit_full(k, shard.units, shard.results, shard.taken)
            except atomic.LostTemp:
                # This run was paused past its lease and another took the shard over (and
                # removed this run's temp as debris): the shard is that run's to commit.
                r.log(f"shard {k}: taken over by another run while this one was paused")
                return
            if done is not None:
                entry, new = done
                r.note_committed(k, entry, new)
                if new:
                    kept = f", {len(shard.taken)} piece(s) merged" if shard.taken else ""
                    r.log(f"shard {k}: committed {entry.get('rows')} row(s){kept}")
        finally:
            r.keeper.release(shard.lock)

    def _checkpoint(self) -> None:
        """Commit the rows finished so far in every open shard as a piece."""
        r = self.r
        for k, shard in self.open.items():
            if shard.results:
                entry = r.committer.commit_piece(k, shard.results)
                if entry is not None:
                    r.note_piece(k, entry, shard.results)
                    shard.taken.append(Piece(k, entry["piece"], entry))
                    shard.results = []
        self.next_checkpoint = time.monotonic() + r.checkpoint_s

    def _wait_for_blocked(self) -> None:
        """Sleep a little, then retry the shards other processes held: committed ones are
        done; those whose holder ended (or whose lease lapsed) go back to the queue."""
        r = self.r
        r.stop.wait(BLOCKED_POLL_S)
        for k, info in list(self.blocked.items()):
            if r.committed_by_entry(k):
                del self.blocked[k]
                continue
            now = locks.inspect(info.path, r.keeper.lease_s)
            if now is None or not now.live:
                del self.blocked[k]
                self.todo.append(k)
            elif r.leave_to_holder(now):
                del self.blocked[k]

    def _close(self, commit: bool) -> None:
        """Commit the finished rows of unfinished shards as pieces (on a graceful stop), then
        release every shard lock (after an error: hand it to Runner.abandon_lock)."""
        r = self.r
        for k, shard in list(self.open.items()):
            try:
                if commit and shard.results:
                    entry = r.committer.commit_piece(k, shard.results)
                    if entry is not None:
                        r.note_piece(k, entry, shard.results)
            finally:
                (r.keeper.release if commit else r.abandon_lock)(shard.lock)
        if commit and self.finished_at_stop is not None:
            r.log(
                f"stop: {self.finished_at_stop} row(s) had finished in this run when the signal "
                f"came, {r.stop.rows_done} by the end of the grace period; all are committed"
            )
