"""Tune the fused MoE kernel's tiles on a GPU: per token bucket, time candidate tiles of a MoE
layer's shape against the default rule, check each winner against the reference, and print
entries for TUNED in kernels/fused_moe_tiles.py.

    python -m batchgen.bench.moe_tune --shape qwen3-30b-a3b --json tune.json

Each candidate runs the whole op (alignment, both grouped GEMMs, the top-k sum) in a CUDA graph,
timed by CUDA events after an L2 flush (the weights stream from HBM as in a step), on routings
of random logits (about uniform over the experts). The search: every BLOCK_M with the gate_up
tile searched first (down at its default), then the down tile with the best gate_up, then
SiLU-and-mul fused against the separate kernel. Row blocks past twice the pairs an expert
gets on average are skipped (mostly padding). The first run compiles a few hundred kernels
(several minutes); pass --tokens to tune a few buckets per call.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from batchgen.bench.timing import graph_median_us
from batchgen.kernels.fused_moe import fused_moe, fused_moe_ref
from batchgen.kernels.fused_moe_tiles import TOKEN_BUCKETS, GemmTile, MoeTiles, default_tiles
from batchgen.kernels.moe_router import topk_softmax

# (experts, top_k, hidden, expert intermediate) of the presets' sparse layers.
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = tuple(b for b in TOKEN_BUCKETS if b <= 4096)
BLOCK_M = (16, 32, 64, 128)
# Column tiles 64-256 wide, K steps of 64 or 128, 4 or 8 warps, 3 or 4 stages, an expert's
# row blocks side by side (GROUP_M 1): 24 per GEMM, compiled once per BLOCK_M (Triton caches
# them); those that do not fit shared memory fail to build and are skipped.
GEMM_TILES = [
    GemmTile(n, k, 1, w, s)
    for n, k, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))
]


def inputs(T: int, E: int, K: int, H: int, I: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    hidden = torch.randn(T, H, device="cuda", generator=g, dtype=dt)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=dt) / H**0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g, dtype=dt) / I**0.5
    logits = torch.randn(T, E, device="cuda", generator=g, dtype=dt)
    weights, ids = topk_softmax(logits, K, True, dt)
    return hidden, w13, w2, weights, ids


def time_us(args, tiles: MoeTiles, flush: torch.Tensor, reps: int) -> float:
    try:
        return graph_median_us(lambda: fused_moe(*args, tiles=tiles), reps, flush.zero_)
    except Exception:  # a tile Triton cannot build (shared memory, registers)
        return float("inf")


def tune(T: int, shape: tuple[int, int, int, int], reps: int) -> dict:
    E, K, H, I = shape
    args = inputs(T, E, K, H, I, seed=T)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # past the 50 MB L2
    default = default_tiles(T, E, K)
    default_us = time_us(args, default, flush, reps)
    best, best_us = default, default_us
    per_expert = T * K / E
    for block_m in [b for b in BLOCK_M if b <= max(16, 2 * per_expert)]:
        base = default._replace(block_m=block_m)
        up = min(GEMM_TILES, key=lambda t: time_us(args, base._replace(gate_up=t), flush, reps))
        base = base._replace(gate_up=up)
        down = min(GEMM_TILES, key=lambda t: time_us(args, base._replace(down=t), flush, reps))
        for fuse in (True, False):
            tiles = base._replace(down=down, fuse_activation=fuse)
            us = time_us(args, tiles, flush, reps)
            if us < best_us:
                best, best_us = tiles, us
    out = fused_moe(*args, tiles=best).float()
    ref = fused_moe_ref(*args).float()
    error = (out - ref).abs().max().item()
    assert error <= 0.05 + 0.05 * ref.abs().max().item(), f"T={T}: winner off by {error}"
    touched = len(args[4].unique())
    weight_bytes = touched * 3 * I * H * 2
    return {
        "tokens": T,
        "default_us": default_us,
        "best_us": best_us,
        "speedup": default_us / best_us,
        "experts_touched": touched,
        "weights_tb_s": weight_bytes / best_us / 1e6,
        "tiles": best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None, help="Write every result to this file.")
    opts = parser.parse_args()
    E, K, H, I = SHAPES[opts.shape]
    rows = []
    print(f"{opts.shape}: {E} experts, top-{K}, {H} -> {I}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'tokens':>7} {'default us':>11} {'best us':>9} {'x':>6} {'experts':>8} {'TB/s':>6}")
    for T in opts.tokens:
        row = tune(T, SHAPES[opts.shape], opts.reps)
        rows.append(row)
        print(
            f"{T:>7} {row['default_us']:>11.1f} {row['best_us']:>9.1f} {row['speedup']:>6.2f} "
            f"{row['experts_touched']:>8} {row['weights_tb_s']:>6.2f}",
            flush=True,
        )
    print("\n# TUNED entries for kernels/fused_moe_tiles.py (winners more than 3% faster):")
    for row in rows:
        if row["speedup"] > 1.03:
            print(f"    ({row['tokens']}, {E}, {H}, {I}, {K}, 'bfloat16'): {row['tiles']!r},")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([{**r, "tiles": repr(r["tiles"])} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
