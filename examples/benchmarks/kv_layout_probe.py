"""Decode attention by KV-cache layout and by how far the live blocks spread over the pool,
llama3.1-8b heads, at the batch sizes a nano run passes through.

The engine's cache is [NB, BS, Hk, D] per layer (NHD: a slot holds all Hk heads, so one
program's (sequence, kv head) reads are 256-byte pieces 2 KB apart). HND ([NB, Hk, BS, D]: a
block holds each head's BS tokens contiguously, 4 KB a block) gives each program contiguous
runs. The kernels take the cache strides, so HND runs here as a transposed view of the same
storage, through the same launch. Spread: "compact" tables use the first blocks of the pool
(the engine's block manager hands out the lowest free ids first); "wide" tables draw blocks
from a pool of the engine's size (about 26,000 blocks on an H100), so the K/V pages a step
touches span the whole cache.

Usage (CUDA machine, repo root): python examples/benchmarks/kv_layout_probe.py [B ...]
Contexts as decode_tile_probe.py (prompts of 100-1024 plus 0..4B generated, longest first);
each CUDA-graph replay runs LAYERS layers' calls over separate caches, so K/V come from HBM;
"+chunk" forks a 128-token chunk's prompt kernel onto a side stream per layer, as a mixed step
does. Prints TB/s of the decode rows' K/V per variant.
"""

from __future__ import annotations

import sys

import torch
from batchgen.kernels.decode_attention import paged_attention_decode
from batchgen.kernels.paged_attention import paged_attention
from decode_tile_probe import nano_contexts

from batchgen.bench.timing import graph_median_us

HQ, HK, D, BS, LAYERS = 32, 8, 128, 16, 8
POOL = 26_000  # blocks per layer in the engine's cache on an H100 (gpu_memory_utilization 0.9)


def views(raw: torch.Tensor, layout: str) -> torch.Tensor:
    """[NB, BS, Hk, D] view of raw [NB, BS * Hk * D] storage in the given layout."""
    if layout == "NHD":
        return raw.view(-1, BS, HK, D)
    return raw.view(-1, HK, BS, D).transpose(1, 2)


def tables_for(ctx: list[int], spread: str, gen: torch.Generator) -> torch.Tensor:
    width = max(-(-c // BS) for c in ctx)
    need = len(ctx) * width
    pool = need if spread == "compact" else max(POOL, need)
    ids = torch.randperm(pool, generator=gen)[:need] if spread == "wide" else torch.arange(need)
    return ids.view(len(ctx), width).int().cuda()


def time_batch(ctx: list[int], side: torch.cuda.Stream, gen: torch.Generator) -> list[str]:
    b = len(ctx)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    pool = max(POOL, len(ctx) * max(-(-c // BS) for c in ctx))
    raws = [
        (torch.randn(pool, BS * HK * D, device="cuda", dtype=torch.bfloat16),
         torch.randn(pool, BS * HK * D, device="cuda", dtype=torch.bfloat16))
        for _ in range(LAYERS)
    ]  # fmt: skip
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cq = torch.randn(128, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 128, 128, 128, 128], dtype=torch.int32, device="cuda")
    clens = torch.tensor([600, 0, 0, 0], dtype=torch.int32, device="cuda")
    ctab = torch.stack([torch.arange(40, device="cuda", dtype=torch.int32) + 1000] * 4)
    cout = torch.empty_like(cq)
    nbytes = LAYERS * 2 * sum(ctx) * HK * D * 2
    cells = []
    for spread in ("compact", "wide"):
        tables = [tables_for(ctx, spread, gen) for _ in range(LAYERS)]
        for layout in ("NHD", "HND"):
            caches = [(views(k, layout), views(v, layout)) for k, v in raws]

            def step(beside: bool, caches=caches, tables=tables) -> None:
                for (k, v), t in zip(caches, tables):
                    if beside:
                        main = torch.cuda.current_stream()
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            paged_attention(cq, k, v, cu, clens, ctab, D**-0.5, 128, out=cout)
                    paged_attention_decode(q, k, v, lens, t, D**-0.5, max_seq_len=2048, out=out)
                    if beside:
                        main.wait_stream(side)

            for beside in (False, True):
                us = graph_median_us(lambda x=beside: step(x), 7)
                name = f"{layout} {spread}{' +chunk' if beside else ''}"
                cells.append(f"{name}: {nbytes / us / 1e6:.2f}")
    return cells


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [34, 54, 80, 128, 192, 256]
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name())
    side = torch.cuda.Stream()
    for b in batches:
        ctx = nano_contexts(b, gen)
        cells = time_batch(ctx, side, gen)
        print(f"B={b:<4} ctx {min(ctx)}-{max(ctx)} TB/s  " + "  ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
