"""Where a whole `nano` run spends its wall time: per-step host time, grouped by step kind.

Runs the workload once per engine setting given (async scheduling on and off by default) and
prints, per group of steps (mixed/prefill steps, then decode steps by batch size), the number
of steps, their total wall time and the mean per step. With async scheduling a step's time is
that of the whole pipeline (host and GPU overlapped), so the sum is the run's wall time.

Usage (CUDA machine, repo root):
    python examples/benchmarks/step_timeline.py [PRESET] [async|sync|async-nosplit ...]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict

import torch

from batchgen.bench.engine_run import build_bench, submit
from batchgen.bench.random_model import preset_config
from batchgen.bench.workloads import nano
from batchgen.config import EngineConfig


def timeline(bench, w, mode: str) -> list[tuple[float, int, int]]:
    """(seconds, running, waiting) per engine step over one whole run of w. mode: "async",
    "sync", or either + "-nosplit" (mixed batches' decode rows through the prefill kernel) or
    "-profile" (print a CPU profile of the steps that admit prompts)."""
    engine = bench.engine(async_scheduling=mode.startswith("async"))
    if mode.endswith("-nosplit"):
        build = engine.runner._context

        def unsplit(step):
            return dataclasses.replace(build(step), num_decode_rows=0)

        engine.runner._context = unsplit
    submit(engine, w, "p")
    rows: list[tuple[float, int, int]] = []
    profiler = None
    if mode.endswith("-profile"):  # the CPU side of the steps that admit prompts
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.start()
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        if profiler is not None and not engine.scheduler.waiting:
            profiler.stop()
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            print(table)
            profiler = None
        running = len(engine.scheduler.running)
        waiting = len(engine.scheduler.waiting)
        engine.step()
        now = time.perf_counter()
        rows.append((now - t, running, waiting))
        t = now
    torch.cuda.synchronize()
    return rows


def report(label: str, rows: list[tuple[float, int, int]]) -> None:
    groups: dict[str, list[float]] = defaultdict(list)
    for seconds, running, waiting in rows:
        if waiting:
            key = "admitting (prefill or mixed)"
        else:
            size = 1 << max(running - 1, 0).bit_length()
            key = f"decode, <= {size:>3} running"
        groups[key].append(seconds)
    total = sum(s for s, _, _ in rows)
    print(f"\n{label}: {len(rows)} steps, {total:.2f} s")
    print(f"{'group':<32} {'steps':>6} {'total s':>8} {'ms/step':>8}")
    for key in sorted(groups):
        times = groups[key]
        print(f"{key:<32} {len(times):>6} {sum(times):>8.2f} {1e3 * sum(times) / len(times):>8.2f}")


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    modes = sys.argv[2:] or ["async", "sync"]
    config = EngineConfig(model="-", dtype="bfloat16", device="cuda")
    vocab = preset_config(preset)["vocab_size"]
    w = nano(256, vocab)
    bench = build_bench(config, preset, None, w.max_request_len())
    timeline(bench, nano(8, vocab), "async")  # warm-up: kernels compiled, graphs used once
    for mode in modes:
        report(f"{preset}, {mode}", timeline(bench, w, mode))


if __name__ == "__main__":
    main()
