"""RankGuard: a tensor-parallel rank's guard against ranks that go different ways.

While the engine starts, it names each phase in which the rank waits on the others (the
watchdog's deadline, distributed/watchdog.py), compares the capture plans before any graph is
captured and the collectives issued while capturing (capture_plan.py), and then lowers the
collective timeout to the steady one. With BATCHGEN_TP_TRACE=1 it logs the phases and every
step (kind, shape, graph bucket) to stderr, one line each, prefixed by the rank. Without tensor
parallel every method does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.watchdog import Watchdog
from batchgen.engine.capture_plan import Agree, CapturePlan, settle_collectives, settle_plan
from batchgen.engine.step_inputs import StepInputs, describe_step


class RankGuard:
    """Args:
    tp: this rank's group (None: no tensor parallel, nothing to guard).
    watchdog: the deadline of this rank's phases (None: no tensor parallel).
    """

    def __init__(self, tp: TensorParallel | None, watchdog: Watchdog | None = None) -> None:
        self.tp = tp
        self.watchdog = watchdog
        self.steps = 0
        if tp is not None:
            tp.watchdog = watchdog

    def log(self, text: str) -> None:
        if self.tp is not None and self.tp.log is not None:
            # One write per line: the ranks share the terminal and must not split each other's.
            self.tp.log.write(f"[tp rank {self.tp.rank}] {text}\n")
            self.tp.log.flush()

    def enter(self, phase: str) -> None:
        """From now on this rank waits on the others in `phase` (until `leave`)."""
        self.log(f"phase: {phase}")
        if self.watchdog is not None:
            self.watchdog.arm(phase)

    def leave(self) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def before_capture(self, agree: Agree, plan: CapturePlan) -> None:
        """Compare the ranks' plans through `agree` (the runner's start-up agreement; raises
        TensorParallelError on every rank if they differ); then record the collectives issued
        until `after_capture`."""
        if self.tp is None:
            return
        self.log(f"capture plan {plan.digest()}: {plan}")
        settle_plan(agree, plan)
        self.tp.record = []

    def after_capture(self, agree: Agree) -> None:
        """Compare the collectives the ranks issued while capturing (raises likewise)."""
        if self.tp is None:
            return
        record, self.tp.record = self.tp.record or [], None
        self.log(f"captured: {len(record)} collectives")
        settle_collectives(agree, record)

    def close(self) -> None:
        """Start-up is over (or failed): no more deadline; collectives get the steady timeout."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.tp is not None:
            self.tp.watchdog = None
            self.tp.record = None

    def started(self) -> None:
        """The engine is ready: close the guard and give collectives the steady timeout."""
        self.close()
        if self.tp is not None:
            self.tp.steady()
            self.log("ready")

    @property
    def expired(self) -> str | None:
        """The watchdog's message if a phase ran out of time, else None."""
        return self.watchdog.expired if self.watchdog is not None else None

    @property
    def logging(self) -> bool:
        """Whether steps are logged (BATCHGEN_TP_TRACE=1 on a tensor-parallel rank)."""
        return self.tp is not None and self.tp.log is not None

    def step(self, step: StepInputs, kind: str) -> None:
        """Log one step: its number, how it runs (kind) and its shape."""
        self.steps += 1
        self.log(f"step {self.steps}: {kind} {describe_step(step)}")
