"""What the tile search of `tune_gemms` adds, for llama3.1-8b's projections at the row counts the
engine's CUDA graphs run.

Usage (CUDA machine, repo root):
    python examples/benchmarks/lt_tile_search.py [ROWS] [SECONDS]
ROWS: comma-separated row counts (default 144,192,224,256,272,320,384); SECONDS: stop
starting new shapes after this long (default 480). Environment: PROJ=qkv,o,gate_up,down,lm_head
picks projections; TOP=N sets gemm_tuning.TUNE_TILE_TOP (how many tiles of each base go on to
the custom option x cluster search).

Per projection and row count, gemm_tuning._time_shape (the engine's own search: candidates
screened on >= 256 MB of rotating weight copies, the fastest confirmed over all of them) runs
twice: with the tile search off (TUNE_TILES_MIN_ROWS = 0) and on at every row count. Prints
cuBLAS's us per call, each search's winner and its config, checks the tile search's winner
against F.linear, and sums the projections x 32 layers by rows.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from batchgen.kernels.cublaslt import LtProduct
from lt_algo_probe import weights

from batchgen.layers import gemm_tuning

# name, N, K, weight K-major, accumulate (the engine's layouts: kn_weights, add_linear_)
PROJECTIONS = [("qkv", 6144, 4096, False, False), ("o", 4096, 4096, False, True),
               ("gate_up", 28672, 4096, True, False), ("down", 4096, 14336, True, True),
               ("lm_head", 128256, 4096, True, False)]  # fmt: skip
ROWS = [144, 192, 224, 256, 272, 320, 384]
LAYERS = 32


def search(ws, acc: bool, m: int, product, tiles: bool) -> dict:
    """gemm_tuning's cache record for this shape, with the tile search on or off."""
    gemm_tuning.TUNE_TILES_MIN_ROWS = 1 if tiles else 0
    return gemm_tuning._time_shape(ws, acc, m, product)


def probe(name, n, k, kn, acc, m) -> tuple[float, float, float]:
    ws = weights(n, k, kn)
    product = LtProduct(m, n, k, torch.bfloat16, kn, k, torch.cuda.current_device(), acc)
    t0 = time.perf_counter()
    tuned = search(ws, acc, m, product, tiles=False)
    t1 = time.perf_counter()
    tiled = search(ws, acc, m, product, tiles=True)
    t2 = time.perf_counter()
    algo = gemm_tuning._record_algo(product, tiled)
    conf, err = "cuBLAS", 0.0
    if algo is not None:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0])
        got = torch.zeros_like(ref)  # accumulating products add into it
        product(x, ws[0], algo, out=got)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        conf = str(algo.config())
    print(
        f"{name:>8} {m:>4}: cublas {tuned['cublas_us']:7.1f}  tuned {tuned['us']:7.1f}  "
        f"+ tiles {tiled['us']:7.1f} ({t1 - t0:.1f}+{t2 - t1:.1f} s, {conf})  "
        f"{tuned['us'] / tiled['us']:5.3f}x  rel err {err:.1e}",
        flush=True,
    )
    return tuned["cublas_us"], tuned["us"], tiled["us"]


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else ROWS
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 480.0
    if "TOP" in os.environ:
        gemm_tuning.TUNE_TILE_TOP = int(os.environ["TOP"])
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    names = os.environ.get("PROJ", "qkv,o,gate_up,down").split(",")
    projections = [p for p in PROJECTIONS if p[0] in names]
    start = time.perf_counter()
    totals = {}
    for m in rows:
        sums = [0.0, 0.0, 0.0]
        for name, n, k, kn, acc in projections:
            if time.perf_counter() - start > budget:
                break
            for i, v in enumerate(probe(name, n, k, kn, acc, m)):
                sums[i] += v * (1 if name == "lm_head" else LAYERS) / 1e3
        else:
            totals[m] = sums
    print("\nprojections x 32 layers, ms: rows, cuBLAS, tuned without tiles, with them, saving")
    for m, (c, t, s) in totals.items():
        print(f"  {m:>4}  {c:6.2f}  {t:6.2f}  {s:6.2f}  {100 * (1 - s / t):5.1f}%")


if __name__ == "__main__":
    main()
