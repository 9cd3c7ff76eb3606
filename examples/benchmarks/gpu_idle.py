"""Where a whole `nano` run leaves the GPU idle: the union of kernel intervals against the wall.

Usage (CUDA machine, repo root): python examples/benchmarks/gpu_idle.py [PRESET]
Runs the workload once untimed, once timed, then once under the CUDA-only profiler (no CPU
activity, so the host side runs as in the timed run) and prints:
  - busy time (union of all kernels and copies over all streams) against the profiled wall;
  - idle time by gap size (launch gaps inside graph replays are a few microseconds; a
    host-bound step leaves gaps of hundreds);
  - steps, cut at each step's last sampling kernel: busy and idle time grouped by the step's
    kernel count (graph-replayed steps of one bucket have one count; eager steps differ),
    and the steps with the most idle time.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from nano_engine import profiled_nano_run

STEP_END = "_argmax_chunks_kernel"  # the sampler's last kernel: one per step
GAP_EDGES_US = (5, 20, 100, 1000)


def kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU activity, sorted by start."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start = e.start_ns() / 1e3
        out.append((start, start + e.duration_ns() / 1e3, e.name()))
    out.sort()
    return out


def busy_and_gaps(acts: list[tuple[float, float, str]]) -> tuple[float, list[tuple[float, float]]]:
    """Union length of the intervals, and the gaps (start, length) between merged intervals."""
    busy = 0.0
    gaps = []
    cur_s, cur_e = acts[0][0], acts[0][1]
    for s, e, _ in acts[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s - cur_e))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, gaps


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "llama3.1-8b"
    prof, wall = profiled_nano_run(preset)
    acts = kernels(prof)
    span = acts[-1][1] - acts[0][0]
    busy, gaps = busy_and_gaps(acts)
    print(
        f"profiled: {wall:.3f} s wall, first-to-last kernel {span / 1e6:.3f} s, busy "
        f"{busy / 1e6:.3f} s, idle {(span - busy) / 1e6:.3f} s in {len(gaps)} gaps"
    )
    lo = 0
    for hi in (*GAP_EDGES_US, float("inf")):
        sel = [g for _, g in gaps if lo <= g < hi]
        print(f"  gaps {lo:>5}-{hi:<6} us: {len(sel):7d}, {sum(sel) / 1e6:.3f} s")
        lo = hi
    # Steps: cut after each step's last sampling kernel.
    steps = []
    begin = 0
    for i, (_, _, name) in enumerate(acts):
        if STEP_END in name:
            steps.append(acts[begin : i + 1])
            begin = i + 1
    print(f"{len(steps)} steps ({len(acts) - begin} activities after the last cut)")
    groups: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    rows = []
    prev_end = steps[0][0][0]
    for k, st in enumerate(steps):
        b, _ = busy_and_gaps(st)
        dur = st[-1][1] - prev_end
        prev_end = st[-1][1]
        g = groups[len(st)]
        g[0] += 1
        g[1] += dur
        g[2] += dur - b
        rows.append((dur - b, dur, len(st), k))
    print("by kernel count: count steps, wall s, idle s")
    for n, (c, d, idle) in sorted(groups.items(), key=lambda kv: -kv[1][2])[:20]:
        print(f"  {n:6d} kernels: {c:5d} steps {d / 1e6:8.3f} s  idle {idle / 1e6:.3f} s")
    print("steps with most idle: step, kernels, wall ms, idle ms")
    for idle, dur, n, k in sorted(rows, reverse=True)[:30]:
        print(f"  {k:5d} {n:6d} {dur / 1e3:8.2f} {idle / 1e3:8.2f}")


if __name__ == "__main__":
    main()
