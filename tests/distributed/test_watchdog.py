"""The start-up watchdog: an armed phase without progress expires once, with a message naming the
rank and phase and the stacks of the rank's threads; progress (beats) and disarming keep it
quiet."""

from __future__ import annotations

import io
import threading
import time

from batchgen.distributed.watchdog import Watchdog


def wait_for(event: threading.Event, seconds: float = 20.0) -> bool:
    return event.wait(seconds)  # generous: the machine may be loaded


def test_a_phase_without_progress_expires_with_rank_phase_and_stacks():
    out = io.StringIO()
    messages: list[str] = []
    fired = threading.Event()

    def on_expire(message: str) -> None:
        messages.append(message)
        fired.set()

    dog = Watchdog(3, on_expire, timeout_s=0.2, out=out)
    dog.arm("capture decode graph bs=16")
    assert wait_for(fired)
    assert len(messages) == 1 and dog.expired == messages[0]
    assert "tensor parallel rank 3: no progress for 0 s" in messages[0]
    assert "'capture decode graph bs=16' (0 collectives issued in it)" in messages[0]
    printed = out.getvalue()
    assert messages[0] in printed
    assert "test_a_phase_without_progress_expires" in printed  # the main thread's stack
    dog.close()


def test_beats_and_disarm_keep_it_quiet():
    fired = threading.Event()
    dog = Watchdog(1, lambda message: fired.set(), timeout_s=0.5, out=io.StringIO())
    dog.arm("one-shot all-reduce set-up")
    deadline = time.monotonic() + 1.5  # three timeouts long, with progress every 0.05 s
    while time.monotonic() < deadline:
        dog.beat()
        time.sleep(0.05)
    dog.disarm()  # a long wait that is not a hang (rank-local work) follows
    time.sleep(1.0)
    assert not fired.is_set() and dog.expired is None
    dog.arm("memory profile")  # armed again, then closed before the deadline
    dog.close()
    time.sleep(1.0)
    assert not fired.is_set()
