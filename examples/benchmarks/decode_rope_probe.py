"""The rope fold in decode attention, in isolation: rope_and_store_kv + paged_attention_decode
against paged_attention_decode_rope (one kernel), qwen3-0.6b heads with q/k-norm, engine-like
ragged contexts (decode_gap_probe.py), timed as CUDA-graph replays of back-to-back calls.

Usage (CUDA machine, repo root): python examples/benchmarks/decode_rope_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from batchgen.kernels.decode_attention import _decode_split_kernel
from batchgen.kernels.ops import paged_attention_decode, paged_attention_decode_rope
from batchgen.kernels.rope_store import rope_and_store_kv
from batchgen.kernels.rotary import build_cos_sin_cache

sys.path.insert(0, str(Path(__file__).parent))
from decode_gap_probe import batch, graph_ms  # noqa: E402

HQ, HK, D, BS = 16, 8, 128, 16


def compare(ctx: list[int], cos_sin, qw, kw) -> tuple[float, float, float]:
    """(unfused us, fused us, max |difference|) for one batch of contexts."""
    _, k_cache, v_cache, lens, tables = batch(ctx)
    b, longest = len(ctx), max(ctx)
    qkv = torch.randn(b, (HQ + 2 * HK) * D, device="cuda", dtype=torch.bfloat16)
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // BS).view(-1, 1).int()).view(-1).long() * BS + pos % BS

    def unfused():
        q = rope_and_store_kv(qkv, pos, cos_sin, HQ, HK, k_cache, v_cache, slots, qw, kw)
        return paged_attention_decode(q, k_cache, v_cache, lens, tables, D**-0.5,
                                      max_seq_len=longest)  # fmt: skip

    def fused():
        return paged_attention_decode_rope(
            qkv, pos, cos_sin, HQ, HK, k_cache, v_cache, slots, lens, tables, D**-0.5,
            qw, kw, 1e-6, max_seq_len=longest,
        )  # fmt: skip

    diff = (unfused().float() - fused().float()).abs().max().item()
    return graph_ms(unfused) * 1e3, graph_ms(fused) * 1e3, diff


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    cos_sin = build_cos_sin_cache(D, 8192, 1e6, None).cuda()
    qw = (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16().cuda()
    kw = (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16().cuda()
    print(torch.cuda.get_device_name())
    for b in (4, 32, 64, 128, 256):
        t = round(1024 - 924 * b / 256)
        ctx = sorted((torch.randint(100, 1025, (b,), generator=gen) + t).tolist(), reverse=True)
        a, f, diff = compare(ctx, cos_sin, qw, kw)
        print(f"B={b:<4} unfused {a:7.1f} us  fused {f:7.1f} us  saved {a - f:5.1f} us "
              f"(max |diff| {diff:.2e})")  # fmt: skip
    for cache in _decode_split_kernel.device_caches.values():
        for kernel in cache[0].values():
            print(f"split kernel variant: {kernel.n_regs} regs, {kernel.n_spills} spills, "
                  f"shared {kernel.metadata.shared} B")  # fmt: skip


if __name__ == "__main__":
    main()
