"""Time kernels/skinny_gemm.py (a decode projection with its norm or activation folded in)
against what it replaces: the separate Triton kernel, then cuBLAS (F.linear).

Usage (CUDA machine, repo root): python examples/benchmarks/skinny_gemm_tune.py [PRESET ...]
Times are CUDA-graph replays (do_bench_cudagraph), each cycling through copies of the weight
totalling at least 256 MB so the weight comes from HBM, as between the layers of a real step.
Prints per projection and row count: the separate kernels, the default tiles, the best tiles.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from batchgen.kernels import ops
from batchgen.kernels.skinny_gemm import (
    ADD_NORM,
    NORM,
    PLAIN,
    SILU_MUL,
    GemmConfig,
    choose_config,
    skinny_gemm,
)
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

SHAPES = {
    # preset: {projection: (K, N, prologue)}
    "qwen3-0.6b": {"qkv": (1024, 4096, ADD_NORM), "o": (2048, 1024, PLAIN),
                   "gate_up": (1024, 6144, ADD_NORM), "down": (3072, 1024, SILU_MUL)},
    "llama3.1-8b": {"qkv": (4096, 6144, ADD_NORM), "o": (4096, 4096, PLAIN),
                    "gate_up": (4096, 28672, ADD_NORM), "down": (14336, 4096, SILU_MUL)},
}  # fmt: skip
ROWS = [4, 32, 64, 128, 256]


def candidates(m: int) -> list[GemmConfig]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = itertools.product((16, 32, 64), (128, 256), (3, 4))
    return [GemmConfig(block_m, bn, bk, 4, s) for bn, bk, s in grid]


def time_us(fn, copies: int) -> float:
    return do_bench_cudagraph(fn, rep=30) * 1e3 / copies


def separate(x, w, prologue, g, residual):
    """What the model runs today: the small kernel, then cuBLAS."""
    if prologue == ADD_NORM:
        x, _ = ops.fused_add_rms_norm(x, residual, g, 1e-6)
    elif prologue == NORM:
        x = ops.rms_norm(x, g, 1e-6)
    elif prologue == SILU_MUL:
        x = ops.silu_and_mul(x)
    return F.linear(x, w)


def tune(m: int, n: int, k: int, prologue: int, ws, g) -> tuple[float, float, float, tuple]:
    """(separate us, default us, best us, best config) for m rows of the weights ws."""
    dt = ws[0].dtype
    x = torch.randn(m, 2 * k if prologue == SILU_MUL else k, device="cuda", dtype=dt)
    res = torch.randn(m, k, device="cuda", dtype=dt)
    ref = separate(x, ws[0], prologue, g, res).float()
    base = time_us(lambda: [separate(x, w, prologue, g, res) for w in ws], len(ws))
    results = []
    for cfg in [choose_config(m, n, k)] + candidates(m):
        if k % cfg.block_k:
            continue
        try:
            out, _ = skinny_gemm(x, ws[0], None, prologue, g, 1e-6, res, cfg)
        except OutOfResources:  # the tile needs more shared memory than an SM has
            continue
        err = (out.float() - ref).abs().max().item()
        if err > 0.02 * ref.abs().max().item():
            print(f"  MISMATCH {cfg}: max error {err}")
            continue

        def run(cfg=cfg):
            for w in ws:
                skinny_gemm(x, w, None, prologue, g, 1e-6, res, cfg)

        results.append((time_us(run, len(ws)), cfg))
    best = min(results)
    return base, results[0][0], best[0], tuple(best[1])


def main() -> None:
    presets = sys.argv[1:] or list(SHAPES)
    torch.manual_seed(0)
    dt = torch.bfloat16
    print(f"{'preset':<12} {'proj':<8} {'M':>4} {'separate us':>11} {'default us':>10} "
          f"{'best us':>8}  best config")  # fmt: skip
    totals: dict[tuple[str, int], list[float]] = {}
    for preset in presets:
        for name, (k, n, prologue) in SHAPES[preset].items():
            copies = max(1, -(-(256 << 20) // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
            g = torch.rand(k, device="cuda", dtype=dt) + 0.5
            for m in ROWS:
                base, default, best, cfg = tune(m, n, k, prologue, ws, g)
                t = totals.setdefault((preset, m), [0.0, 0.0, 0.0])
                t[0] += base
                t[1] += default
                t[2] += best
                print(f"{preset:<12} {name:<8} {m:>4} {base:>11.1f} {default:>10.1f} "
                      f"{best:>8.1f}  {cfg}", flush=True)  # fmt: skip
    print("per layer (four projections):")
    for (preset, m), (base, default, best) in totals.items():
        print(f"  {preset:<12} M={m:>4}: separate {base:6.1f} us, default {default:6.1f} us, "
              f"best {best:6.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
