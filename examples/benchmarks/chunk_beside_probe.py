"""How a mixed step should run its riding chunk's attention beside the decode rows': llama3.1-8b
heads, decode batches as nano's run has them, one 128-token chunk of one prompt.

The engine forks the chunk's prompt kernel (64-query x 64-key tiles, 4 warps, 3 stages; 2 x 32
programs) onto a side stream ahead of the decode kernel. At 48-192 decode rows that costs the
decode rows 2-11% (decode_tile_probe.py): the chunk's few long programs hold SM slots the decode
kernel's wave needs. This times, per layer (us; 16 layers per CUDA-graph replay, each over its
own caches so K/V come from HBM):
  alone        the decode kernel only (the floor);
  side MxN/wW/sS  the chunk's kernel on the side stream with other tiles (query rows, key
               rows, warps, stages): fewer, larger programs or more, shorter ones;
  serial MxN   the chunk's kernel then the decode kernel on one stream;
  rows         the chunk's 128 tokens as 128 more rows of the decode kernel (one query each
               over its own prefix, as the riding rows of a mixed graph run): one launch.

Usage (CUDA machine, repo root): python examples/benchmarks/chunk_beside_probe.py [B ...]
"""

from __future__ import annotations

import sys

import torch
from batchgen.kernels.decode_attention import _tiles as decode_tiles
from batchgen.kernels.decode_attention import launch_decode
from batchgen.kernels.paged_attention import launch_attention
from decode_tile_probe import HK, HQ, LAYERS, D, caches, chunk_args, nano_contexts

from batchgen.bench.timing import graph_median_us

SIDE_TILES = {  # name: (BLOCK_M, BLOCK_N, warps, stages) of the chunk's prompt kernel
    "side 64x64/w4/s3": (64, 64, 4, 3),
    "side 128x64/w8/s3": (128, 64, 8, 3),
    "side 32x64/w4/s3": (32, 64, 4, 3),
    "side 16x64/w4/s3": (16, 64, 4, 3),
    "side 64x128/w4/s2": (64, 128, 4, 2),
    "side 32x128/w4/s2": (32, 128, 4, 2),
}
SERIAL_TILES = {"serial 64x64": (64, 64, 4, 3), "serial 32x64": (32, 64, 4, 3)}


def chunk_rows(ctx: list[int], lens: torch.Tensor, tables: torch.Tensor, chunk) -> tuple:
    """The decode kernel's seq_lens / block tables with the chunk's 128 tokens appended as rows:
    token i of the chunk at position 472 + i sees keys 0 .. 472 + i."""
    cache_tables = chunk[5]
    pos = torch.arange(473, 601, dtype=torch.int32, device="cuda")
    width = max(tables.shape[1], cache_tables.shape[1])
    pad = torch.zeros(len(ctx) + 128, width, dtype=torch.int32, device="cuda")
    pad[: len(ctx), : tables.shape[1]] = tables
    pad[len(ctx) :, : cache_tables.shape[1]] = cache_tables[0]
    return torch.cat([lens, pos]), pad


def time_batch(ctx: list[int], side: torch.cuda.Stream) -> list[str]:
    b = len(ctx)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    layers = [caches(ctx) for _ in range(LAYERS)]
    chunks = [chunk_args(k, v, k.shape[0]) for k, v, _ in layers]
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    chunk_out = torch.empty(128, HQ, D, device="cuda", dtype=torch.bfloat16)
    tiles = decode_tiles()
    scale = D**-0.5

    def decode(k, v, tables):
        launch_decode(q, k, v, lens, tables, scale, 1, *tiles, out=out)

    def run_chunk(chunk, t):
        cq, ck, cv, cu, clens, ctables, _, max_q = chunk
        launch_attention(cq, ck, cv, cu, clens, ctables, scale, max_q, True, t, out=chunk_out)

    def alone():
        for k, v, tables in layers:
            decode(k, v, tables)

    def beside(t):
        def step():
            main = torch.cuda.current_stream()
            for (k, v, tables), chunk in zip(layers, chunks):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    run_chunk(chunk, t)
                decode(k, v, tables)
                main.wait_stream(side)

        return step

    def serial(t):
        def step():
            for (k, v, tables), chunk in zip(layers, chunks):
                run_chunk(chunk, t)
                decode(k, v, tables)

        return step

    rows_args = [
        chunk_rows(ctx, lens, tables, chunk) for (_, _, tables), chunk in zip(layers, chunks)
    ]
    q_rows = torch.randn(b + 128, HQ, D, device="cuda", dtype=torch.bfloat16)
    out_rows = torch.empty_like(q_rows)

    def rows():
        for (k, v, _), (rlens, rtables) in zip(layers, rows_args):
            launch_decode(q_rows, k, v, rlens, rtables, scale, 1, *tiles, out=out_rows)

    runs = {"alone": alone}
    runs.update({name: beside(t) for name, t in SIDE_TILES.items()})
    runs.update({name: serial(t) for name, t in SERIAL_TILES.items()})
    runs["rows"] = rows
    cells = []
    for name, fn in runs.items():
        us = graph_median_us(fn, 7) / LAYERS
        cells.append(f"{name} {us:.1f}")
    return cells


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [34, 48, 64, 80, 100, 128, 160, 192, 256]
    gen = torch.Generator().manual_seed(0)
    print(torch.cuda.get_device_name(), "us a layer; chunk: 128 tokens at 472-599; HK", HK)
    side = torch.cuda.Stream()
    for b in batches:
        ctx = nano_contexts(b, gen)
        cells = time_batch(ctx, side)
        print(f"B={b:<4} ctx {min(ctx)}-{max(ctx)}  " + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
