"""Progress: a tqdm bar on stderr of the rows a task owes, with rows/s, generated tok/s, ETA."""

from __future__ import annotations

import sys
import time
from collections import deque

from tqdm import tqdm

# The bar: "37%|####      | 370/1000 [01:51<03:09, 3.33row/s, 212.4 gen tok/s]". rows/s is
# never inverted to s/row, so the two rates read the same way.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
WINDOW_S = 30.0  # generated tok/s is measured over about the last this many seconds


class Progress:
    """Rows done (results and error records) of `total` owed, and generated tokens/s.

    The counters are kept whether or not the bar is shown. tok/s counts from the first
    finished row on (so the model's load time is not in it), over a sliding window of about
    WINDOW_S seconds, as the rows/s and the ETA of tqdm follow the recent rate.
    """

    def __init__(self, enabled: bool, total: int | None = None):
        self.total = total
        self.rows = 0
        self.tokens = 0
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens so far) per update
        self._bar = (
            tqdm(
                total=total,
                unit="row",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
                bar_format=BAR_FORMAT if total is not None else None,
            )
            if enabled
            else None
        )

    def update(self, rows: int, generated_tokens: int) -> None:
        self.rows += rows
        self.tokens += generated_tokens
        now = time.monotonic()
        self._window.append((now, self.tokens))
        # Keep one point at or before the window's start as the reference.
        while len(self._window) > 2 and self._window[1][0] <= now - WINDOW_S:
            self._window.popleft()
        if self._bar is None:
            return
        rate = self.tokens_per_s()
        if rate is not None:
            self._bar.set_postfix_str(f"{rate:.1f} gen tok/s", refresh=False)
        self._bar.update(rows)

    def tokens_per_s(self) -> float | None:
        """Generated tokens/s over the window; None before two updates (no interval yet)."""
        if len(self._window) < 2:
            return None
        (t0, k0), (t1, k1) = self._window[0], self._window[-1]
        return (k1 - k0) / (t1 - t0) if t1 > t0 else None

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
