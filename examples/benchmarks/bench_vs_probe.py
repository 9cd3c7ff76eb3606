"""Does the bench's own timing cost anything? In one process, alternate `batchgen bench`-style
runs (`run_engine`: the timer holds the submission of the 256 requests) with probe-style runs
(the timer starts after submission, as `first_run_steps.py` times), each on a fresh engine
after the same warm-up.

Usage (CUDA machine, repo root): python examples/benchmarks/bench_vs_probe.py [ceilings] [RUNS]
`ceilings` measures the matmul and copy ceilings first, as the bench does before it builds the
model. Prints each run's wall time (and the submission's, for probe-style runs).
"""

from __future__ import annotations

import sys
import time

import torch
from nano_engine import nano_bench

from batchgen.bench.ceilings import measure_ceilings
from batchgen.bench.engine_run import drain, run_engine, submit, warm_up


def probe_style(bench, w) -> tuple[float, float]:
    """(run s after submission, submission s) on a fresh engine after the bench's warm-up."""
    engine = bench.engine()
    warm_up(engine, w)
    torch.cuda.synchronize()
    s0 = time.perf_counter()
    submit(engine, w, "")
    t0 = time.perf_counter()
    drain(engine)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, t0 - s0


def main() -> None:
    args = sys.argv[1:]
    if "ceilings" in args:
        print(measure_ceilings(torch.device("cuda"), torch.bfloat16), flush=True)
        args.remove("ceilings")
    runs = int(args[0]) if args else 6
    bench, w, _ = nano_bench("llama3.1-8b")
    for i in range(runs):
        if i % 2 == 0:
            print(f"bench-style {run_engine(bench, w).wall_s:.3f} s", flush=True)
        else:
            wall, sub = probe_style(bench, w)
            print(f"probe-style {wall:.3f} s (+ submit {1e3 * sub:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
