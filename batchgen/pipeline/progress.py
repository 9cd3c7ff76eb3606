"""Progress: a tqdm bar on stderr counting rows, with generated tokens/s."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """Rows done (results and error records) and generated-token throughput; no-op if disabled."""

    def __init__(self, enabled: bool, total: int | None = None):
        self._bar = (
            tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
            if enabled
            else None
        )
        self._start = time.monotonic()
        self._tokens = 0

    def update(self, rows: int, generated_tokens: int) -> None:
        self._tokens += generated_tokens
        if self._bar is None:
            return
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self._tokens / elapsed:.1f} tok/s", refresh=False)
        self._bar.update(rows)

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
