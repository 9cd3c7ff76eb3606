"""Watchdog: a deadline on a tensor-parallel rank's start-up phases that wait on the other ranks.

Ranks that went different ways (a graph one rank captures and another does not, a collective
one rank issues and another skips) wait for each other forever: NCCL kernels replayed from a
CUDA graph and the one-shot kernel's barrier spin on the GPU, out of reach of any collective
timeout. The watchdog turns that into an error. While a phase is armed, every collective the
rank issues (TensorParallel calls `beat`) restarts the deadline; a rank that makes no progress
for `timeout_s` prints what it was doing and the stacks of its threads, then calls `on_expire`
with a message naming the rank and phase (a worker reports it to rank 0 and exits; rank 0
aborts its NCCL communicators so the waiting call returns and the engine raises it).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TextIO

# No progress for this long inside an armed phase is a hang. Longer than the start-up timeout
# of the collectives and the rendezvous store (group.STARTUP_TIMEOUT_S), so that a wait those
# can end raises its own error first.
WATCHDOG_TIMEOUT_S = 180.0


class Watchdog:
    """Deadline for one rank's armed phase (see the module docstring).

    Args:
        rank: this rank (named in the message).
        on_expire: called once, from the watchdog's thread, with the message.
        timeout_s: seconds without progress that count as a hang.
        out: where the message and the thread stacks are printed.
    """

    def __init__(
        self,
        rank: int,
        on_expire: Callable[[str], None],
        timeout_s: float = WATCHDOG_TIMEOUT_S,
        out: TextIO | None = None,
    ) -> None:
        self.rank = rank
        self.on_expire = on_expire
        self.timeout_s = timeout_s
        self.out = out
        self.expired: str | None = None  # the message, once the deadline passed
        self._phase: str | None = None
        self._last = 0.0  # monotonic time of the last progress in the armed phase
        self._beats = 0
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._thread.start()

    def arm(self, phase: str) -> None:
        """Enter `phase` (waiting on the other ranks from now on): the deadline starts."""
        with self._wake:
            self._phase, self._last, self._beats = phase, time.monotonic(), 0
            self._wake.notify()

    def beat(self) -> None:
        """Progress (a collective issued): restart the armed phase's deadline."""
        self._last = time.monotonic()
        self._beats += 1

    def disarm(self) -> None:
        """Leave the armed phase (rank-local work, or a wait that may be long, follows)."""
        with self._wake:
            self._phase = None

    def close(self) -> None:
        with self._wake:
            self._closed, self._phase = True, None
            self._wake.notify()

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                if self._phase is None:
                    self._wake.wait()
                    continue
                left = self._last + self.timeout_s - time.monotonic()
                if left > 0:
                    self._wake.wait(min(left, 1.0))
                    continue
                message = (
                    f"tensor parallel rank {self.rank}: no progress for {self.timeout_s:.0f} s "
                    f"in start-up phase {self._phase!r} ({self._beats} collectives issued in "
                    "it); the ranks are waiting on each other: they captured different graphs "
                    "or issued different collectives, or one of them is stuck"
                )
                self.expired, self._phase = message, None
                break
        if self.expired is not None:
            self._report(self.expired)
            self.on_expire(self.expired)

    def _report(self, message: str) -> None:
        out = self.out or sys.stderr
        stacks = []
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            stacks.append(f"thread {ident}:\n" + "".join(traceback.format_stack(frame)))
        try:
            print(f"batchgen: {message}\n" + "\n".join(stacks), file=out, flush=True)
        except (OSError, ValueError):  # the stream is closed: the message still reaches rank 0
            pass
