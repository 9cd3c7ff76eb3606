"""Decode attention's key tile by batch size, llama3.1-8b heads: alone, and beside a riding
chunk's prompt kernel on a side stream (as a mixed step runs them).

The split kernel runs 128-key tiles in 2 stages (3 programs an SM) since the sixteenth session,
0.3-0.5% faster than 64-key tiles in 3 stages (4 an SM) over a whole nano run. At one split, B
sequences are B x Hk programs: 34-66 rows are 272-528 programs against 396 slots (128-key
tiles) or 528 (64-key), so mid-size batches may rank the tiles otherwise. This times both
(and 2 splits) at the batch sizes a llama3.1-8b nano run passes through.

Usage (CUDA machine, repo root): python examples/benchmarks/decode_tile_probe.py [B ...]
Contexts follow llama3.1-8b's nano run while its batch grows (prompts of 100-1024 tokens plus
0..4B generated), longest first; each CUDA-graph replay runs 16 layers' calls over 16 separate
caches, so K/V come from HBM. Beside: each layer forks a 128-token chunk's prompt kernel (one
prompt, 600 keys of context, the mixed graphs' 4-sequence grid) onto a side stream and joins it
after decode.
Prints TB/s of the decode rows' K/V per variant.
"""

from __future__ import annotations

import sys

import torch
from batchgen.kernels.decode_attention import launch_decode
from batchgen.kernels.paged_attention import paged_attention

from batchgen.bench.timing import graph_median_us

HQ, HK, D, BS, LAYERS = 32, 8, 128, 16, 16
VARIANTS = {  # name: (splits, block_n, warps, stages)
    "128x2 S1": (1, 128, 4, 2),
    "64x3 S1": (1, 64, 4, 3),
    "128x2 S2": (2, 128, 4, 2),
    "64x3 S2": (2, 64, 4, 3),
}


def caches(ctx: list[int]):
    """One layer's paged cache holding the contexts, as the engine lays it out."""
    width = max(-(-c // BS) for c in ctx)
    nb = len(ctx) * width + 64
    tables = torch.randperm(len(ctx) * width, device="cuda").view(len(ctx), width).int()
    k = torch.randn(nb, BS, HK, D, device="cuda", dtype=torch.bfloat16)
    return k, torch.randn_like(k), tables


def chunk_args(k, v, nb: int):
    """A 128-token chunk of one prompt at positions 472-599, in the 4-sequence grid."""
    q = torch.randn(128, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 128, 128, 128, 128], dtype=torch.int32, device="cuda")
    lens = torch.tensor([600, 0, 0, 0], dtype=torch.int32, device="cuda")
    table = torch.arange(nb - 40, nb, device="cuda", dtype=torch.int32)
    tables = torch.stack([table] * 4)
    return q, k, v, cu, lens, tables, D**-0.5, 128


def time_batch(ctx: list[int], side: torch.cuda.Stream) -> list[str]:
    """TB/s of each variant, alone then beside the chunk, for decode rows of these contexts."""
    b = len(ctx)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    layers = [caches(ctx) for _ in range(LAYERS)]
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    chunks = [chunk_args(k, v, k.shape[0]) for k, v, _ in layers]
    chunk_out = torch.empty(128, HQ, D, device="cuda", dtype=torch.bfloat16)
    nbytes = LAYERS * 2 * sum(ctx) * HK * D * 2

    def step(splits: int, tiles: tuple, beside: bool) -> None:
        for (k, v, tables), chunk in zip(layers, chunks):
            if beside:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    paged_attention(*chunk, out=chunk_out)
            launch_decode(q, k, v, lens, tables, D**-0.5, splits, *tiles, out=out)
            if beside:
                main.wait_stream(side)

    cells = []
    for beside in (False, True):
        for name, (splits, *tiles) in VARIANTS.items():
            us = graph_median_us(lambda s=splits, t=tuple(tiles), x=beside: step(s, t, x), 7)
            cells.append(f"{'+chunk ' if beside else ''}{name}: {nbytes / us / 1e6:.2f}")
    return cells


def nano_contexts(b: int, gen: torch.Generator) -> list[int]:
    """Context lengths of b running sequences, longest first, as llama3.1-8b's nano run has
    them while its batch grows: about one sequence joins every 4 steps (prompts ride), so at b
    rows they have generated 0..4b tokens on prompts of 100-1024."""
    grown = torch.randint(0, 4 * b + 1, (b,), generator=gen)
    return sorted((torch.randint(100, 1025, (b,), generator=gen) + grown).tolist(), reverse=True)


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [34, 40, 48, 54, 60, 66, 80, 100, 128, 192, 256]
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name())
    side = torch.cuda.Stream()
    for b in batches:
        ctx = nano_contexts(b, gen)
        cells = time_batch(ctx, side)
        print(f"B={b:<4} ctx {min(ctx)}-{max(ctx)} TB/s  " + "  ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
