"""cuBLASLt's candidate algorithms against cuBLAS's pick, for llama3.1-8b's projections by rows.

Usage (CUDA machine, repo root): python examples/benchmarks/lt_algo_probe.py [ROWS] [COUNT]
ROWS: comma-separated row counts (default: decode sizes through the ridge); COUNT: how many
candidates to ask the heuristic for (default 32). Environment: PROJ=qkv,o,gate_up,down picks
projections; REFINE=R also times the R fastest candidates with other cluster shapes and K
splits (their indexes start at 1000).

Each projection is timed in its engine layout (qkv and o as stored, gate_up and down K-major,
`kn_weights`), weights from HBM (rotating copies totalling >= 256 MB), in CUDA-graph replays:
F.linear (cuBLAS's own pick), then every candidate cuBLASLt's heuristic lists. Prints us per
call for cuBLAS, the heuristic's first candidate and the fastest one (its rank and config),
then the four projections x 32 layers in ms by rows, cuBLAS against the fastest candidates.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from batchgen.kernels.cublaslt import CublasLtError, LtProduct

from batchgen.layers.gemm_tuning import _graph_us, candidates

# name, N, K, weight K-major (the engine's layouts with kn_weights on)
PROJECTIONS = [("qkv", 6144, 4096, False), ("o", 4096, 4096, False),
               ("gate_up", 28672, 4096, True), ("down", 4096, 14336, True)]  # fmt: skip
ROWS = [16, 32, 64, 128, 160, 192, 224, 256, 272, 288, 320, 352, 384, 448, 512]
LAYERS = 32
WIDEN = True
# Variants of the REFINE fastest candidates: cluster shapes (cublasLtClusterShape_t: 1x1, 2x1,
# 4x1, 1x2, 2x2, 1x4) x K splits.
REFINE = int(os.environ.get("REFINE", "0"))
CLUSTERS = [2, 3, 4, 5, 6, 8]
SPLITS = [1, 2, 3, 4]


def weights(n: int, k: int, kn: bool) -> list[torch.Tensor]:
    copies = max(1, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    return [w.t().contiguous().t() for w in ws] if kn else ws


def refine(product, x, ws, out, timed) -> list:
    """The REFINE fastest candidates again with other cluster shapes and K splits."""
    extra, seen = [], {bytes(c.algo) for _, c in timed}
    index = 1000
    for _, cand in sorted(timed, key=lambda t: t[0])[:REFINE]:
        for cluster in CLUSTERS:
            for split in SPLITS:
                conf = {"cluster": cluster, "splitk": split}
                if split > 1:
                    conf["reduction"] = 2  # CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                var = cand.variant(index, **conf)
                if var is None or bytes(var.algo) in seen:
                    continue
                seen.add(bytes(var.algo))
                var = product.check(var, index)
                if var is None:
                    continue
                index += 1
                try:
                    us = _graph_us(lambda w, c=var: product(x, w, c, out), ws)
                except (CublasLtError, RuntimeError):
                    continue
                extra.append((us, var))
    return extra


def probe(name: str, n: int, k: int, kn: bool, m: int, count: int) -> tuple[float, float]:
    ws = weights(n, k, kn)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cublas = _graph_us(lambda w: F.linear(x, w), ws)
    product = LtProduct(m, n, k, torch.bfloat16, kn, k, torch.cuda.current_device())
    timed = []
    for cand in candidates(product, count, widen=WIDEN):
        try:
            us = _graph_us(lambda w, c=cand: product(x, w, c, out), ws)
        except (CublasLtError, RuntimeError) as exc:  # a candidate that will not launch
            print(f"  {name} M={m} candidate {cand.index}: {exc}")
            continue
        timed.append((us, cand))
    if not timed:
        print(f"{name:>8} {m:>4}: no candidate launched")
        return cublas, cublas
    if REFINE:
        timed += refine(product, x, ws, out, timed)
    best_us, best = min(timed, key=lambda t: t[0])
    ref = F.linear(x, ws[0])
    got = product(x, ws[0], best)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    first = next((us for us, c in timed if c.index == 0), float("nan"))
    own = min(us for us, c in timed if c.index < 8)
    wide = min(us for us, c in timed if c.index < 1000)
    print(
        f"{name:>8} {m:>4}: cublas {cublas:7.1f}  lt#0 {first:7.1f}  best {best_us:7.1f} "
        f"(#{best.index} of {len(timed)}, {best.config()}, own best {own:7.1f}, "
        f"widened {wide:7.1f})  "
        f"{cublas / best_us:5.2f}x  "
        f"rel err {err:.1e}"
    )
    return cublas, best_us


def main() -> None:
    rows = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else ROWS
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    names = os.environ.get("PROJ")
    projections = [p for p in PROJECTIONS if not names or p[0] in names.split(",")]
    totals = {}
    for m in rows:
        cub = best = 0.0
        for name, n, k, kn in projections:
            c, b = probe(name, n, k, kn, m, count)
            cub, best = cub + c, best + b
        totals[m] = (cub * LAYERS / 1e3, best * LAYERS / 1e3)
    print("\nfour projections x 32 layers, ms: rows, cuBLAS, fastest candidates, saving")
    for m, (c, b) in totals.items():
        print(f"  {m:>4}  {c:6.2f}  {b:6.2f}  {100 * (1 - b / c):5.1f}%")


if __name__ == "__main__":
    main()
