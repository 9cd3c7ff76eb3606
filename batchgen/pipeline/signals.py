"""Graceful stop: SIGTERM / SIGUSR1 / SIGINT ask the runner to finish up and exit 75."""

from __future__ import annotations

import signal
import threading
import time

from batchgen.pipeline.exit_codes import EX_TEMPFAIL

__all__ = ["EX_TEMPFAIL", "STOP_SIGNALS", "GracefulStop", "StopFlag"]

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


class StopFlag:
    """Set by a stop signal (or by hand); the runner polls `is_set()` between engine steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self.at: float | None = None
        # Rows the run has finished, counted by the runner; read at the signal's moment
        # (handlers run in the main thread, between the runner's statements).
        self.rows_done = 0
        self.rows_done_at_stop: int | None = None

    def set(self, name: str = "stop") -> None:
        if not self._event.is_set():
            self.signal_name, self.at = name, time.monotonic()
            self.rows_done_at_stop = self.rows_done
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, waking at once if the flag is set."""
        return self._event.wait(timeout)


class GracefulStop:
    """Context manager installing the stop-signal handlers (main thread only), restoring on exit.

    A second SIGINT while stopping raises KeyboardInterrupt (abandon everything now).
    """

    def __init__(self, flag: StopFlag):
        self.flag = flag
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.flag.is_set() and name == "SIGINT":
            raise KeyboardInterrupt
        self.flag.set(name)

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self.flag

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
