"""Short full garbage collections while engines run.

A full (generation-2) collection walks every tracked object in the process: with torch, the
model and the tokenizer loaded that is a pause of about 0.1 s on the host, during which the
GPU runs dry (the host launches one step ahead). Frozen objects are skipped by every
collection, so an engine freezes the heap that existed before its run and unfreezes it when
its last request is done: the run's own objects are still collected, and nothing frozen
stays frozen past the run (gc.unfreeze hands those objects back to the oldest generation).
Several engines in one process share the freeze: the heap is unfrozen when the last one
releases it.
"""

from __future__ import annotations

import gc
import threading

# 0 leaves the collector alone (engine sweeps compare both).
GC_FREEZE = 1

_lock = threading.Lock()
_holders = 0


class HeapFreeze:
    """One engine's hold on the process-wide freeze: hold() when a run starts, release() when
    it ends; both are idempotent, so release() may also run from a finalizer."""

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        global _holders
        if self.held or not GC_FREEZE:
            return
        with _lock:
            if _holders == 0:
                gc.freeze()
            _holders += 1
        self.held = True

    def release(self) -> None:
        global _holders
        if not self.held:
            return
        with _lock:
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()
        self.held = False


def holders() -> int:
    """Engines holding the freeze now (tests)."""
    return _holders
