"""One Triton GEMM of ridge_gemm_probe.py, launched plainly (no CUDA graph): does its first
call return, does it equal F.linear, and how fast is it against F.linear.

ridge_gemm_probe.py times inside CUDA-graph replays and prints a shape only after all its
variants are timed, so a kernel that never returns leaves it silent. This runs one variant and
tile at a time; run it under `timeout` to tell a hang from a slow kernel.

Usage (CUDA machine, repo root):
    timeout 45 python examples/benchmarks/ws_gemm_check.py VARIANT M N K BM,BN,BK,WARPS,STAGES
VARIANT: tiled, persistent, tiled-ws or persistent-ws (ridge_gemm_probe.KERNELS). The weight
[N, K] rotates over copies of >= 256 MB, so each call reads it from HBM.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import ridge_gemm_probe  # noqa: E402
import triton_gemm_probe  # noqa: E402


def plain_us(fn, ws: list[torch.Tensor], rounds: int = 5) -> float:
    """Microseconds a call over back-to-back plain launches, one per weight copy."""
    for w in ws[:2]:
        fn(w)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        for w in ws:
            fn(w)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(ws))


def main() -> None:
    variant, m, n, k = sys.argv[1], *map(int, sys.argv[2:5])
    cfg = tuple(map(int, sys.argv[5].split(",")))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = triton_gemm_probe.hbm_weights(n, k)
    t0 = time.time()
    out = ridge_gemm_probe.gemm(x, ws[0], cfg, variant)
    torch.cuda.synchronize()
    print(f"{variant} {cfg} M={m}: first call (compile + run) {time.time() - t0:.1f} s", flush=True)
    ref = F.linear(x, ws[0]).float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    triton_us = plain_us(lambda w: ridge_gemm_probe.gemm(x, w, cfg, variant), ws)
    cublas_us = plain_us(lambda w: F.linear(x, w), ws)
    print(f"  rel err {err:.0e}; Triton {triton_us:.1f} us, F.linear {cublas_us:.1f} us")


if __name__ == "__main__":
    main()
