"""Tile configurations of the fused MoE GEMMs, per layer shape and token count.

Each routed batch of T tokens runs two grouped GEMMs over one sorted layout (moe_align), so both
share BLOCK_M; BLOCK_N / BLOCK_K / GROUP_M / warps / stages are per GEMM. TUNED holds
measured winners keyed by (token bucket, experts, hidden, expert intermediate, top-k, dtype
name); anything else gets default_tiles, a rule of thumb: few pairs per expert (decode) want
small row blocks and wide K steps (the GEMM streams weights), many want the square tiles of a
compute-bound GEMM. `python -m batchgen.bench.moe_tune` times candidates on a GPU and prints
entries for TUNED.
"""

from __future__ import annotations

from typing import NamedTuple


class GemmTile(NamedTuple):
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class MoeTiles(NamedTuple):
    block_m: int
    gate_up: GemmTile  # hidden [T, H] x w13 [E, 2I, H] (with SiLU-and-mul when fused)
    down: GemmTile  # act [T * K, I] x w2 [E, H, I], weighted by the routing
    fuse_activation: bool = True  # SiLU-and-mul in gate_up's epilogue, else its own kernel


# Token counts a tile choice is made for: a batch of T tokens takes the smallest bucket >= T.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)

# (bucket, experts, hidden, intermediate, top_k, dtype) -> tiles: the winners more than 3% faster
# than default_tiles in `python -m batchgen.bench.moe_tune --shape qwen3-30b-a3b --tokens 1 16 64
# 256 1024` (H200, 2026-11-27, 3a90cfd; 1-64 tokens: the default won). Shapes and buckets not
# listed run default_tiles (mixtral-8x7b, tensor-parallel slices: not tuned yet).
TUNED: dict[tuple[int, int, int, int, int, str], MoeTiles] = {
    # 256 tokens: 314.4 us against 335.6 (1.07x)
    (256, 128, 2048, 768, 8, "bfloat16"): MoeTiles(
        32, GemmTile(64, 128, 1, 4, 3), GemmTile(128, 128, 1, 4, 3), fuse_activation=True
    ),
    # 1024 tokens: 389.9 us against 452.5 (1.16x)
    (1024, 128, 2048, 768, 8, "bfloat16"): MoeTiles(
        64, GemmTile(64, 64, 1, 4, 3), GemmTile(128, 64, 1, 8, 3), fuse_activation=True
    ),
}

# Shared memory a config may use per program (the H100 offers 227 KB; leave room for the
# compiler's own staging).
_SMEM_BYTES = 200 * 1024


def token_bucket(num_tokens: int) -> int:
    """The smallest TOKEN_BUCKETS entry >= num_tokens (the largest past the last)."""
    return next((b for b in TOKEN_BUCKETS if b >= num_tokens), TOKEN_BUCKETS[-1])


def _fit_stages(tile: GemmTile, block_m: int, itemsize: int, operands_b: int) -> GemmTile:
    """Fewer pipeline stages where A and B tiles of `itemsize` bytes would not fit in shared
    memory (fp32 doubles the bf16 footprint; the fused gate_up loads two B tiles)."""
    per_stage = (block_m * tile.block_k + operands_b * tile.block_k * tile.block_n) * itemsize
    stages = max(1, min(tile.num_stages, _SMEM_BYTES // per_stage))
    return tile._replace(num_stages=stages)


def default_tiles(num_tokens: int, num_experts: int, top_k: int) -> MoeTiles:
    """Rule-of-thumb tiles from the average pairs an expert receives: row blocks about twice
    that (most experts then take one block, so their weights are read once), narrow column
    tiles with long K steps while the GEMMs stream weights, wide ones with 8 warps past that.
    The fused gate_up tile loads two weight tiles (gate and up), so it is half as wide."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 8:
        return MoeTiles(16, GemmTile(64, 128, 1, 4, 4), GemmTile(128, 128, 1, 4, 3))
    wide_up, wide_down = GemmTile(128, 64, 1, 8, 3), GemmTile(256, 64, 1, 8, 3)
    block_m = 32 if per_expert <= 16 else 64 if per_expert <= 64 else 128
    return MoeTiles(block_m, wide_up, wide_down)


def tile_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    dtype_name: str,
    itemsize: int,
) -> MoeTiles:
    """The tiles for a routed batch of num_tokens tokens: TUNED's entry, else default_tiles,
    with pipeline stages cut to what shared memory holds at this dtype."""
    key = (token_bucket(num_tokens), num_experts, hidden, inter, top_k, dtype_name)
    tiles = TUNED.get(key) or default_tiles(num_tokens, num_experts, top_k)
    return tiles._replace(
        gate_up=_fit_stages(
            tiles.gate_up, tiles.block_m, itemsize, 2 if tiles.fuse_activation else 1
        ),
        down=_fit_stages(tiles.down, tiles.block_m, itemsize, 1),
    )
