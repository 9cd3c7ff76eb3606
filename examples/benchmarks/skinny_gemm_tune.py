"""Time kernels/skinny_gemm.py against cuBLAS (F.linear) at the decode-step projections of the
bench presets, for its default tiles and for a grid of candidate tiles.

Usage (CUDA machine, repo root): python examples/benchmarks/skinny_gemm_tune.py [PRESET ...]
Times are CUDA-graph replays (do_bench_cudagraph), each cycling through copies of the weight
totalling at least 256 MB so the weight comes from HBM, as between the layers of a real step.
Prints per shape and row count: cuBLAS, the default config, and the best candidate.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from batchgen.kernels.skinny_gemm import GemmConfig, choose_config, skinny_gemm
from triton.testing import do_bench_cudagraph

SHAPES = {
    # preset: {projection: (K, N)}
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144),
                   "down": (3072, 1024)},
    "llama3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                    "down": (14336, 4096)},
}  # fmt: skip
ROWS = [4, 64, 128, 256]


def candidates(m: int, k: int) -> list[GemmConfig]:
    block_ms = sorted({max(16, min(128, 1 << (m - 1).bit_length())), 64 if m > 64 else 16})
    out = []
    for bm, bn, bk, split, warps in itertools.product(
        block_ms, (32, 64, 128), (64, 128), (1, 2, 4, 8), (4, 8)
    ):
        if k % (split * bk) == 0 and not (warps == 8 and bm * bn < 64 * 64):
            out.append(GemmConfig(bm, bn, bk, split, warps, 4))
    return out


def time_us(fn, copies: int) -> float:
    return do_bench_cudagraph(fn, rep=30) * 1e3 / copies


def main() -> None:
    presets = sys.argv[1:] or list(SHAPES)
    torch.manual_seed(0)
    dt = torch.bfloat16
    print(f"{'preset':<12} {'proj':<8} {'M':>4} {'cuBLAS us':>9} {'default us':>10} "
          f"{'best us':>8}  best config")  # fmt: skip
    for preset in presets:
        for name, (k, n) in SHAPES[preset].items():
            copies = max(1, -(-(256 << 20) // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(copies)]
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                ref = F.linear(x, ws[0])
                base = time_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws], copies)
                default = choose_config(m, n, k, x.device)
                results = []
                for cfg in [default] + candidates(m, k):
                    out = skinny_gemm(x, ws[0], cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    if err > 0.05 * ref.float().abs().max().item():
                        print(f"  MISMATCH {cfg}: max error {err}")
                        continue

                    def run(x=x, ws=ws, cfg=cfg):
                        for w in ws:
                            skinny_gemm(x, w, cfg)

                    t = time_us(run, copies)
                    results.append((t, cfg))
                best = min(results)
                print(f"{preset:<12} {name:<8} {m:>4} {base:>9.1f} {results[0][0]:>10.1f} "
                      f"{best[0]:>8.1f}  {tuple(best[1])}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
