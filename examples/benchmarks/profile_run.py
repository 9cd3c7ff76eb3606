"""Kernel time of one whole `nano` run, summed by kernel and by kind, against its wall time.

Usage (CUDA machine, repo root): python examples/benchmarks/profile_run.py [PRESET]
Runs the workload once untimed (warm-up and compiles), once timed, then once more under the
profiler, and prints GPU time per kernel kind over the run: where the time between the
decode roofline and the measured wall goes.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from nano_engine import profiled_nano_run

# Substrings of kernel names -> the kind reported; the first match wins.
KINDS = [
    ("_decode_split_kernel", "decode attention"),
    ("_decode_reduce_kernel", "decode reduce"),
    ("_attention_kernel", "prefill attention"),
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("splitKreduce", "gemm"),
    ("_rms_norm", "rms norm"),
    ("_rope_store", "rope + store"),
    ("_silu", "silu"),
    ("gumbel", "sampling"),
    ("Memcpy", "copies"),
    ("copy", "copies"),
]


def kind(name: str) -> str:
    return next((k for sub, k in KINDS if sub in name), "other")


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    prof, wall = profiled_nano_run(preset)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time_total
            by_name[e.name][1] += 1
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        by_kind[kind(name)] += us
    total = sum(by_kind.values())
    print(f"profiled run: {wall:.3f} s wall, {total / 1e6:.3f} s of kernels")
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {us / 1e6:8.3f} s  {100 * us / total:5.1f}%")
    print("top kernels:")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {us / 1e6:8.3f} s {n:7d} calls {us / max(n, 1):8.2f} us  {name[:80]}")


if __name__ == "__main__":
    main()
