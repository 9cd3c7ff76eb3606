"""Time the decode-step projections of the bench presets at decode batch sizes: cuBLAS through
F.linear on the [N, K] weight as stored, and through torch.mm on a [K, N] copy (a different
cuBLAS layout, so possibly a different kernel choice).

Usage (CUDA machine, repo root): python examples/benchmarks/gemm_shapes.py [waves | curve]
`waves` instead times llama3.1-8b's gate_up shape (K=4096) at widths around its 28,672: if
cuBLAS's output tiles fill the 132 SMs in whole waves only, time steps up with whole waves of
tiles instead of growing with the width.
`curve [M,M,... [VARIANT,...]]` sums llama3.1-8b's four projections over its 32 layers at
M = 32 .. 512 rows (or the rows given); VARIANTs (linear, lt, kn; see time_linear) are timed
side by side per projection.
Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), as the engine's decode steps
run; each replay cycles through copies of the weight totalling at least 256 MB, so the weight
comes from HBM, not the 50 MB L2, as it does between the layers of a real step.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

SHAPES = {
    # preset: {projection: (K, N)}
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144),
                   "down": (3072, 1024), "lm_head": (1024, 151936)},
    "llama3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                    "down": (14336, 4096), "lm_head": (4096, 128256)},
}  # fmt: skip
BATCHES = [4, 64, 128, 256]
CURVE_ROWS = [32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512]


def time_linear(m: int, k: int, n: int, variant: str = "linear") -> float:
    """Microseconds of one [m, k] x [n, k]^T product, weights from HBM (CUDA-graph replays).
    variant: "linear" (F.linear, cuBLAS), "lt" (F.linear with cuBLASLt preferred) or "kn"
    (torch.mm on a [k, n] copy of the weight)."""
    copies = max(1, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    if variant == "kn":
        ws = [w.t().contiguous() for w in ws]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def product():
        for w in ws:
            torch.mm(x, w) if variant == "kn" else F.linear(x, w)

    backend = torch.backends.cuda.preferred_blas_library()
    if variant == "lt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return do_bench_cudagraph(product, rep=50) * 1e3 / copies
    finally:
        torch.backends.cuda.preferred_blas_library(backend)


def waves() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gate_up widths (K=4096), us and weight TB/s; {sms} SMs, 128-column tiles per wave: "
          f"{sms * 128}")  # fmt: skip
    for m in (64, 128, 256):
        cells = []
        for n in (8448, 16896, 22528, 28672, 33792):
            us = time_linear(m, 4096, n)
            cells.append(f"N={n}: {us:6.1f} us {n * 4096 * 2 / us / 1e6:4.2f}")
        print(f"  M={m:<4} " + "  ".join(cells), flush=True)


def curve(rows: list[int], variants: list[str]) -> None:
    """llama3.1-8b's four projections x 32 layers, ms per step by rows M: what a prompt chunk
    riding in a decode step adds to the step's GEMMs (marginal us a row against the last M).
    With several variants, each M also gets every variant's per-projection us."""
    shapes = {name: s for name, s in SHAPES["llama3.1-8b"].items() if name != "lm_head"}
    nbytes = 32 * sum(k * n * 2 for k, n in shapes.values())
    print("llama3.1-8b projections x 32 layers, by rows M: ms, weight TB/s, us a row added")
    last = None
    for m in rows:
        us = {v: {p: time_linear(m, k, n, v) for p, (k, n) in shapes.items()} for v in variants}
        ms = 32 * sum(us[variants[0]].values()) / 1e3
        add = "" if last is None else f" {(ms - last[1]) * 1e3 / (m - last[0]):6.1f}"
        line = f"  M={m:<4} {ms:6.2f} ms {nbytes / ms / 1e9:5.2f}{add:>7}"
        if len(variants) > 1:
            for v in variants:
                cells = " ".join(f"{p}={t:.1f}" for p, t in us[v].items())
                line += f" | {v}: {32 * sum(us[v].values()) / 1e3:6.2f} ms {cells}"
        print(line, flush=True)
        last = (m, ms)


def main() -> None:
    if sys.argv[1:] == ["waves"]:
        waves()
        return
    if sys.argv[1:2] == ["curve"]:
        rows = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else CURVE_ROWS
        curve(rows, sys.argv[3].split(",") if len(sys.argv) > 3 else ["linear"])
        return
    torch.manual_seed(0)
    print(f"{'preset':<12} {'proj':<8} {'M':>4} {'linear us':>10} {'mm(K,N) us':>11} "
          f"{'linear TB/s':>11} {'TFLOP/s':>8}")  # fmt: skip
    for preset, shapes in SHAPES.items():
        for name, (k, n) in shapes.items():
            for m in BATCHES:
                a = time_linear(m, k, n)
                b = time_linear(m, k, n, "kn")
                tbs = (n * k * 2 + m * (k + n) * 2) / (a * 1e-6) / 1e12
                tflops = 2 * m * n * k / (a * 1e-6) / 1e12
                print(f"{preset:<12} {name:<8} {m:>4} {a:>10.1f} {b:>11.1f} {tbs:>11.2f} "
                      f"{tflops:>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
