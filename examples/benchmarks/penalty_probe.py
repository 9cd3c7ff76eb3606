"""Throughput of `nano` with history penalties (repetition, frequency/presence) against plain
temperature sampling, same engine and requests: what a job that sets a penalty pays.

Usage (CUDA machine, repo root): python examples/benchmarks/penalty_probe.py [PRESET] [N]
(PRESET default qwen3-0.6b; N requests, default 256).
"""

from __future__ import annotations

import sys

from nano_engine import nano_bench

from batchgen.bench.engine_run import drain, submit, warm_up
from batchgen.bench.timing import timed
from batchgen.bench.workloads import Workload

VARIANTS = {
    "plain": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "frequency 0.2 + presence 0.1": {"frequency_penalty": 0.2, "presence_penalty": 0.1},
}


def timed_run(engine, w: Workload, prefix: str, penalties: dict) -> float:
    """Seconds to drain the queued requests (submission not timed)."""
    submit(engine, w, prefix, **penalties)
    seconds, errors = timed(lambda: drain(engine), engine.runner.device)
    assert errors == 0, f"{errors} error outputs"
    return seconds


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    bench, w, _ = nano_bench(preset)
    w = Workload(w.name, w.prompts[:n], w.max_tokens[:n])
    out_tokens = sum(w.max_tokens)
    engine = bench.engine(enable_prefix_caching=False)
    warm_up(engine, w)
    for i, name in enumerate(["plain", *VARIANTS]):  # plain twice: the first run warms
        s = timed_run(engine, w, f"{i}-", VARIANTS[name])
        print(f"{preset} {n} requests, {name:30s} {s:7.2f} s {out_tokens / s:9,.0f} tok/s",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
