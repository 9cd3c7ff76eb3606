"""Search cuBLASLt's tile and stages ids, not only the heuristic's list, for llama3.1-8b's
projections at the row counts the engine's CUDA graphs run.

Usage (CUDA machine, repo root):
    python examples/benchmarks/lt_tile_search.py [ROWS] [SECONDS]
ROWS: comma-separated row counts (default 144,192,224,256,272,320,384); SECONDS: stop
starting new shapes after this long (default 480). Environment: PROJ=qkv,o,gate_up,down,lm_head
picks projections; TOP=N tiles go on to the stages x cluster search (default 6).

Per projection and row count, each timed like the engine's tuning (gemm_tuning._graph_us: every
rotating weight copy in one CUDA graph, median of 3 replays):
1. cuBLAS's pick, and what tune_projections finds today (heuristic, neighbours, clusters);
2. the heuristic's first candidate, and its first with split-K, with every tile id cuBLASLt
   lists for the algorithm (those AlgoCheck accepts);
3. the TOP fastest tiles of each with every custom option and cluster shape.
Prints us per call and the fastest config, checks its output against F.linear, and sums the
projections x 32 layers by rows.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from batchgen.kernels.cublaslt import CublasLtError, LtProduct

from batchgen.layers import gemm_tuning
from batchgen.layers.gemm_tuning import _graph_us

# name, N, K, weight K-major, accumulate (the engine's layouts: kn_weights, add_linear_)
PROJECTIONS = [("qkv", 6144, 4096, False, False), ("o", 4096, 4096, False, True),
               ("gate_up", 28672, 4096, True, False), ("down", 4096, 14336, True, True),
               ("lm_head", 128256, 4096, True, False)]  # fmt: skip
ROWS = [144, 192, 224, 256, 272, 320, 384]
LAYERS = 32
TOP = int(os.environ.get("TOP", "6"))
CLUSTERS = (0, 2, 3, 4, 5, 6, 8)  # auto, 1x1, 2x1, 4x1, 1x2, 2x2, 1x4


def weights(n: int, k: int, kn: bool) -> list[torch.Tensor]:
    copies = max(1, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return [w.t().contiguous().t() for w in ws] if kn else ws


def timer(product, x, ws, out):
    def time_us(cand) -> float | None:
        try:
            return _graph_us(lambda w: product(x, w, cand, out=out), ws)
        except (CublasLtError, RuntimeError):
            return None

    return time_us


def search(product, time_us) -> list[tuple[float, object]]:
    """Steps 2 and 3: (us, candidate) for every config timed."""
    heur = product.candidates(8)
    timed, seen = [], set()

    def try_(base, index, **conf):
        var = base.variant(index, **conf)
        if var is None or bytes(var.algo) in seen:
            return None
        seen.add(bytes(var.algo))
        var = product.check(var, index)
        if var is None:
            return None
        us = time_us(var)
        if us is None:
            return None
        timed.append((us, var))
        return us

    # Bases: the heuristic's first candidate, and its first with split-K (their custom option
    # and other fields set as cuBLASLt wants them; an algorithm from AlgoInit is refused).
    bases = heur[:1] + [c for c in heur if c.config()["splitk"] > 1][:1]
    for base in bases:
        conf0 = base.config()
        tiles = base.supported("tile")
        by_tile = []
        for tile in tiles:
            us = try_(base, 2000 + len(timed), tile=tile)
            if us is not None:
                by_tile.append((us, tile))
        by_tile.sort()
        print(
            f"    base {conf0}: {len(tiles)} tiles listed, {len(by_tile)} run; custom max "
            f"{base.custom_option_max()}; fastest {by_tile[:TOP]}",
            flush=True,
        )
        for _, tile in by_tile[:TOP]:
            for custom in range(base.custom_option_max() + 1):
                for cluster in CLUSTERS:
                    try_(base, 2000 + len(timed), tile=tile, custom=custom, cluster=cluster)
    return timed


def probe(name, n, k, kn, acc, m) -> tuple[float, float, float]:
    ws = weights(n, k, kn)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
    product = LtProduct(m, n, k, torch.bfloat16, kn, k, torch.cuda.current_device(), acc)
    t0 = time.perf_counter()
    record = gemm_tuning._time_shape(ws, acc, m, product)
    t1 = time.perf_counter()
    timed = search(product, timer(product, x, ws, out))
    t2 = time.perf_counter()
    cublas, tuned = record["cublas_us"], record["us"]
    if not timed:
        print(f"{name:>8} {m:>4}: cublas {cublas:7.1f} tuned {tuned:7.1f}: nothing timed")
        return cublas, tuned, tuned
    best_us, best = min(timed, key=lambda t: t[0])
    ref = F.linear(x, ws[0])
    got = torch.zeros_like(ref)
    product(x, ws[0], best, out=got)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    print(
        f"{name:>8} {m:>4}: cublas {cublas:7.1f}  tuned {tuned:7.1f}  search {best_us:7.1f} "
        f"({len(timed)} timed, {t1 - t0:.1f}+{t2 - t1:.1f} s, {best.config()})  "
        f"{tuned / best_us:5.3f}x over tuned  rel err {err:.1e}",
        flush=True,
    )
    return cublas, tuned, min(best_us, tuned)


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else ROWS
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 480.0
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
    print("\nprojections x 32 layers, ms: rows, cuBLAS, tuned today, with the tile search")
    for m, (c, t, s) in totals.items():
        print(f"  {m:>4}  {c:6.2f}  {t:6.2f}  {s:6.2f}  {100 * (1 - s / t):5.1f}%")


if __name__ == "__main__":
    main()
