"""How Triton pipelined the decode attention kernel: per tile choice, the shared memory and
registers of the compiled split kernel and the K/V buffers its pipeline allocated.

Usage (CUDA machine, repo root): python examples/benchmarks/pipeline_buffers.py
The block-table load takes a pipeline stage of its own, so K/V get fewer buffers than
num_stages suggests; one buffer means a program has a single K/V tile in flight.
"""

from __future__ import annotations

import re

import torch
from batchgen.kernels.decode_attention import _decode_split_kernel, launch_decode

# (BLOCK_N, num_warps, num_stages)
TILES = [(64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 4, 2), (128, 4, 3), (32, 4, 6), (64, 8, 3)]


def main() -> None:
    b, hq, hk, d, bs, nb = 32, 16, 8, 128, 16, 4096
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((b,), 1000, dtype=torch.int32, device="cuda")
    tables = torch.randint(0, nb, (b, 128), dtype=torch.int32, device="cuda")
    for tiles in TILES:
        launch_decode(q, k_cache, v_cache, lens, tables, d**-0.5, 2, *tiles)
    torch.cuda.synchronize()
    for cache in _decode_split_kernel.device_caches.values():
        for kernel in cache[0].values():
            md = kernel.metadata
            ttgir = kernel.asm["ttgir"]
            # K and V buffers: the leading dim of their [stages, BLOCK_N, D] shared allocations.
            kv = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x\d+x", ttgir)
            buffers = sorted({(int(n), int(rows)) for n, rows in kv})
            print(f"num_warps={md.num_warps} num_stages={md.num_stages}: shared {md.shared} B, "
                  f"{kernel.n_regs} registers, K/V buffers (count, BLOCK_N) {buffers}")  # fmt: skip


if __name__ == "__main__":
    main()
