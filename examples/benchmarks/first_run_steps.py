"""Where the bench's first timed run loses time against the later ones: the host wall time of
every engine step, run by run, as `batchgen bench --repeat 3` runs them (one process; each run
on a fresh engine over the same model and runner, after the same warm-up).

Usage (CUDA machine, repo root):
    python examples/benchmarks/first_run_steps.py [PRESET] [RUNS] [MODULE.NAME=VALUE ...]
MODULE.NAME=VALUE sets an engine constant before the model and runner are built, as
`sweep_engine.py` does (e.g. `mixed_graph.RIDE_PADDING_ROWS=0`). FILL=0 in the environment
gives the old 16-request warm-up (the bench's warm-up now fills one full step).
Steps are matched by index (the schedule is the same in every run). Prints each run's wall
time, then per kind of step (eager steps: a prompt chunk larger than a mixed step carries, as
in the first admission and due prompts; the rest) the
seconds of each run, and the steps where the first run lost the most against the median of
the others, with their row counts.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from nano_engine import nano_bench
from sweep_engine import parse, patch_constants

from batchgen.bench.engine_run import submit, warm_up

# 1: the warm-up's prompts fill one full step, as `batchgen bench`'s do; FILL=0: 16 requests only
# (the bench before 2026-11-23's twenty-first session).
FILL_FIRST_STEP = os.environ.get("FILL", "1") == "1"


def timed_steps(bench, w) -> tuple[float, list[tuple[float, int, bool]]]:
    """One bench-like run: (wall s, [(step s, rows, eager)])."""
    engine = bench.engine()
    warm_up(engine, w, fill_step=FILL_FIRST_STEP)
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats()["num_alloc_retries"]
    chunk = engine.scheduler.mixed_chunk_tokens  # prompt tokens a mixed step carries (0: off)
    submit(engine, w, "")
    seen = []  # the batch each schedule() call made, to label the step that made it
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append(out)
        return out

    engine.scheduler.schedule = spy
    steps = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        seen.clear()
        s0 = time.perf_counter()
        engine.step()
        rows = sum(x.num_new_tokens for o in seen for x in o.scheduled)
        eager = any(x.num_new_tokens > max(chunk, 1) for o in seen for x in o.scheduled)
        steps.append((time.perf_counter() - s0, rows, eager))
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats()["num_alloc_retries"] - retries
    print(f"allocator retries in the run (each frees cached blocks, synchronizing): {retries}")
    return time.perf_counter() - t0, steps


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama3.1-8b"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    patch_constants(parse(",".join(sys.argv[3:])) if sys.argv[3:] else {})
    bench, w, _ = nano_bench(preset)
    results = [timed_steps(bench, w) for _ in range(runs)]
    for i, (wall, steps) in enumerate(results):
        big = sum(t for t, _, eager in steps if eager)
        print(f"run {i + 1}: {wall:.2f} s wall, {len(steps)} steps; "
              f"eager steps (a prompt chunk past the mixed steps' size) {big:.3f} s, other steps "
              f"{sum(t for t, _, e in steps if not e):.3f} s")  # fmt: skip
    first = results[0][1]
    rest = [r[1] for r in results[1:]]
    n = min(len(s) for s in [first, *rest])
    loss = []
    for k in range(n):
        ref = statistics.median(r[k][0] for r in rest)
        loss.append((first[k][0] - ref, k, first[k][1], first[k][2]))
    total = sum(x[0] for x in loss)
    print(f"first run minus the others' median, summed over steps: {total:.3f} s")
    for d, k, rows, eager in sorted(loss, reverse=True)[:12]:
        print(f"  step {k:>5}: +{d * 1e3:7.2f} ms  rows {rows:>6}  {'eager' if eager else ''}")


if __name__ == "__main__":
    main()
