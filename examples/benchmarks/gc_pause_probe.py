"""How long a full garbage collection pauses the host while an engine runs: with the heap from
before the run frozen (the engine's default, batchgen/engine/gc_pause.py) and unfrozen.

Usage: python examples/benchmarks/gc_pause_probe.py MODEL_DIR
Any machine; the tiny model is enough, since the heap is mostly torch, triton and transformers.
Prints the objects frozen and the median of 5 full collections each way.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch  # noqa: F401 - part of the heap a real run has
import transformers  # noqa: F401
import triton  # noqa: F401

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.sampling_params import SamplingParams


def full_collection_ms(repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", max_model_len=256))
    for i in range(64):
        engine.add_request(f"r{i}", [0, *range(5, 60)], SamplingParams(max_tokens=32))
    engine.step()  # the run has started: the engine holds the freeze
    print(f"python {sys.version.split()[0]}, objects frozen: {gc.get_freeze_count()}")
    print(f"full collection, pre-run heap frozen: {full_collection_ms():.2f} ms")
    gc.unfreeze()
    print(f"full collection, nothing frozen:      {full_collection_ms():.2f} ms")
    gc.freeze()  # give the engine back its freeze; it releases it when the run ends
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
