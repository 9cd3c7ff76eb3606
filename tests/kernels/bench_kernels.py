"""Time each Triton kernel against its torch reference on CUDA at realistic shapes.

Usage (repository root, a CUDA machine):
    PYTHONPATH=. python tests/kernels/bench_kernels.py [--tune]

Prints one table: median time (triton.testing.do_bench) of the kernel and of the reference (or
a torch peer: SDPA for attention), the speed-up, and the kernel's achieved HBM bandwidth or
TFLOP/s. --tune also times tile variants of the two attention kernels. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
from batchgen.kernels.activation import silu_and_mul, silu_and_mul_ref
from batchgen.kernels.decode_attention import (
    choose_num_splits,
    launch_decode,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from batchgen.kernels.kv_cache import store_kvcache, store_kvcache_ref
from batchgen.kernels.logprobs import token_logprobs, token_logprobs_ref
from batchgen.kernels.paged_attention import launch_attention, paged_attention, varlen_attention
from batchgen.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from batchgen.kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref
from batchgen.kernels.sampling import gumbel_argmax, gumbel_argmax_ref

DEV = "cuda"
BF16 = torch.bfloat16
ROWS: list[tuple[str, float, float | None, str]] = []


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def record(name: str, fn, ref=None, nbytes: float | None = None, flops: float | None = None):
    ms = bench(fn)
    ref_ms = bench(ref) if ref is not None else None
    if flops is not None:
        rate = f"{flops / ms / 1e9:7.1f} TFLOP/s"
    elif nbytes is not None:
        rate = f"{nbytes / ms / 1e6:7.0f} GB/s"
    else:
        rate = ""
    ROWS.append((name, ms, ref_ms, rate))
    print(f"  {name}: {ms:.4f} ms", flush=True)


def paged_batch(q_lens, ctx_lens, hq, hk, d, bs=16):
    """A paged cache holding every sequence's full context and the new tokens' queries."""
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    tables = torch.randperm(num_blocks, device=DEV).view(len(seq_lens), max_blocks).int()
    k_cache = torch.randn(num_blocks, bs, hk, d, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=BF16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, cu, lens, tables


def attention_flops(q_lens, ctx_lens, hq, d) -> float:
    # QK^T and PV over the causal (visible) pairs only.
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in zip(q_lens, ctx_lens))
    return 4 * hq * d * pairs


def sdpa_peer(q_lens, ctx_lens, hq, hk, d):
    """Torch SDPA (flash) on dense [B, H, L, D] tensors of the same work, a throughput peer."""
    b, n, c = len(q_lens), q_lens[0], ctx_lens[0]
    q = torch.randn(b, hq, n, d, device=DEV, dtype=BF16)
    k = torch.randn(b, hk, n + c, d, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    mask = None
    if c:
        pos = torch.arange(n + c, device=DEV)
        mask = pos[None, :] <= (pos[c:])[:, None]
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )


def bench_elementwise():
    T, H = 8192, 4096
    x = torch.randn(T, H, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(H, device=DEV, dtype=BF16)
    record("rms_norm [8192, 4096]", lambda: rms_norm(x, w, 1e-5),
           lambda: rms_norm_ref(x, w, 1e-5), nbytes=2 * x.numel() * 2)  # fmt: skip
    record("fused_add_rms_norm [8192, 4096]", lambda: fused_add_rms_norm(x, r, w, 1e-5),
           lambda: fused_add_rms_norm_ref(x, r, w, 1e-5), nbytes=4 * x.numel() * 2)  # fmt: skip
    qk = torch.randn(T * 32 * 128 // 2048, 2048, device=DEV, dtype=BF16)  # q-norm rows, D=128
    rows, w128 = qk.view(-1, 128), w[:128]
    record("rms_norm q-norm [262144, 128]", lambda: rms_norm(rows, w128, 1e-6),
           lambda: rms_norm_ref(rows, w128, 1e-6), nbytes=2 * qk.numel() * 2)  # fmt: skip

    cache = build_cos_sin_cache(128, 131072, 500000.0, None).to(DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    q = torch.randn(T, 32, 128, device=DEV, dtype=BF16)
    k = torch.randn(T, 8, 128, device=DEV, dtype=BF16)
    record("rotary T=8192 32/8x128", lambda: rotary_embedding(pos, q, k, cache),
           lambda: rotary_embedding_ref(pos, q, k, cache),
           nbytes=2 * (q.numel() + k.numel()) * 2)  # fmt: skip

    g = torch.randn(T, 2 * 14336, device=DEV, dtype=BF16)
    record("silu_and_mul [8192, 2x14336]", lambda: silu_and_mul(g), lambda: silu_and_mul_ref(g),
           nbytes=1.5 * g.numel() * 2)  # fmt: skip

    kk, vv = (
        torch.randn(T, 8, 128, device=DEV, dtype=BF16),
        torch.randn(T, 8, 128, device=DEV, dtype=BF16),
    )
    k_cache = torch.empty(T // 16 + 8, 16, 8, 128, device=DEV, dtype=BF16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEV)[:T]
    record("store_kvcache T=8192 8x128", lambda: store_kvcache(kk, vv, k_cache, v_cache, slots),
           lambda: store_kvcache_ref(kk, vv, k_cache, v_cache, slots),
           nbytes=4 * kk.numel() * 2)  # fmt: skip

    logits = torch.randn(256, 151936, device=DEV) / 0.6
    seeds = torch.randint(0, 2**62, (256,), device=DEV)
    steps = torch.randint(0, 1000, (256,), device=DEV)
    record("gumbel_argmax [256, 151936]", lambda: gumbel_argmax(logits, seeds, steps),
           lambda: gumbel_argmax_ref(logits, seeds, steps), nbytes=logits.numel() * 4)  # fmt: skip

    lg = torch.randn(2048, 128256, device=DEV, dtype=BF16)
    tgt = torch.randint(0, 128256, (2048,), device=DEV)
    record("token_logprobs [2048, 128256] bf16", lambda: token_logprobs(lg, tgt),
           lambda: token_logprobs_ref(lg, tgt), nbytes=lg.numel() * 2)  # fmt: skip


PREFILL_CASES = {
    # name: (q_lens, ctx_lens, Hq, Hk)
    "prefill 4x2048 (llama-8B heads)": ([2048] * 4, [0] * 4, 32, 8),
    "prefill 8x1024 (qwen3-0.6B heads)": ([1024] * 8, [0] * 8, 16, 8),
    "extend 16x(2048 cached + 128 new)": ([128] * 16, [2048] * 16, 32, 8),
}


PREFILL_TILES = [
    (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 3),
    (64, 64, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3),
]  # fmt: skip


def bench_prefill(tune: bool):
    for name, (q_lens, ctx_lens, hq, hk) in PREFILL_CASES.items():
        args = paged_batch(q_lens, ctx_lens, hq, hk, 128)
        flops = attention_flops(q_lens, ctx_lens, hq, 128)
        longest = max(q_lens)
        record(name, lambda a=args, m=longest: paged_attention(*a, 128**-0.5, m),
               sdpa_peer(q_lens, ctx_lens, hq, hk, 128), flops=flops)  # fmt: skip
        if not ctx_lens[0]:
            # The same kernel on contiguous K/V: the cost of reading through the block table.
            q, k_cache, v_cache, cu = args[:4]
            k = k_cache.flatten(0, 1)[: q.shape[0]]
            v = v_cache.flatten(0, 1)[: q.shape[0]]
            fn = functools.partial(varlen_attention, q, k, v, cu, longest, 128**-0.5)
            record("  varlen (contiguous K/V)", fn, flops=flops)
        if not tune:
            continue
        for tiles in PREFILL_TILES:
            fn = lambda a=args, m=longest, t=tiles: launch_attention(  # noqa: E731
                *a, 128**-0.5, m, True, t
            )
            record(f"  tiles {tiles}", fn, flops=flops)


DECODE_CASES = {
    # name: (batch, context, Hq, Hk)
    "decode B=1 ctx=4096": (1, 4096, 32, 8),
    "decode B=16 ctx=2048": (16, 2048, 32, 8),
    "decode B=64 ctx=1024": (64, 1024, 32, 8),
    "decode B=256 ctx=1024 (llama-8B heads)": (256, 1024, 32, 8),
    "decode B=256 ctx=1024 (qwen3-0.6B heads)": (256, 1024, 16, 8),
}


def bench_decode(tune: bool):
    for name, (b, ctx, hq, hk) in DECODE_CASES.items():
        q, k_cache, v_cache, _, lens, tables = paged_batch([1] * b, [ctx - 1] * b, hq, hk, 128)
        args = (q, k_cache, v_cache, lens, tables)
        nbytes = 2 * b * ctx * hk * 128 * 2
        record(name, lambda a=args, n=ctx: paged_attention_decode(*a, 128**-0.5, max_seq_len=n),
               lambda a=args: paged_attention_decode_ref(*a, 128**-0.5), nbytes=nbytes)  # fmt: skip
        if not tune:
            continue
        splits = choose_num_splits(b, hk, ctx, q.device)
        for heads_first in (True, False):
            fn = lambda a=args, s=splits, h=heads_first: launch_decode(  # noqa: E731
                *a, 128**-0.5, s, 64, 4, 3, h
            )
            record(f"  default tiles, heads_first={heads_first}", fn, nbytes=nbytes)
        for splits in (1, 4, 16):
            for block_n, warps, stages in [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
                                           (64, 8, 3), (128, 4, 2), (128, 8, 3)]:  # fmt: skip
                fn = lambda a=args, s=splits, n=block_n, w=warps, st=stages: launch_decode(  # noqa: E731
                    *a, 128**-0.5, s, n, w, st
                )
                record(f"  splits={splits} tiles=({block_n},{warps},{stages})", fn, nbytes=nbytes)


# Contexts as in `nano` mid-run (prompt 100-1024 plus up to 1024 generated), longest first as
# the scheduler orders decode rows: name -> (batch, shortest, longest, Hq, Hk).
RAGGED_DECODE_CASES = {
    "decode B=256 ragged 100-2048 (qwen3-0.6B heads)": (256, 100, 2048, 16, 8),
    "decode B=256 ragged 100-2048 (llama-8B heads)": (256, 100, 2048, 32, 8),
    "decode B=64 ragged 100-2048 (qwen3-0.6B heads)": (64, 100, 2048, 16, 8),
    "decode B=128 ragged 100-2048 (qwen3-0.6B heads)": (128, 100, 2048, 16, 8),
    "decode B=32 ragged 500-2048 (qwen3-0.6B heads)": (32, 500, 2048, 16, 8),
    "decode B=128 ragged 100-2048 (llama-8B heads)": (128, 100, 2048, 32, 8),
}
# (BLOCK_N, warps, stages). The block-table load takes a pipeline stage of its own: 3 or 4
# stages give K/V one buffer, 5 or 6 give two (read from the compiled kernel, 2026-11-23).
RAGGED_TILES = [
    (32, 4, 6), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2),
    (64, 4, 4), (64, 4, 5), (64, 8, 5), (128, 4, 3), (128, 8, 4),
]  # fmt: skip


def bench_ragged_decode(tune: bool):
    gen = torch.Generator().manual_seed(0)
    for name, (b, lo, hi, hq, hk) in RAGGED_DECODE_CASES.items():
        ctx = sorted(torch.randint(lo, hi + 1, (b,), generator=gen).tolist(), reverse=True)
        q, k_cache, v_cache, _, lens, tables = paged_batch(
            [1] * b, [c - 1 for c in ctx], hq, hk, 128
        )
        args = (q, k_cache, v_cache, lens, tables)
        nbytes = 2 * sum(ctx) * hk * 128 * 2
        longest = max(ctx)
        record(name, lambda a=args, n=longest: paged_attention_decode(*a, 128**-0.5, max_seq_len=n),
               nbytes=nbytes)  # fmt: skip
        if not tune:
            continue
        for splits in (1, 2, 4):
            for block_n, warps, stages in RAGGED_TILES:
                fn = lambda a=args, s=splits, n=block_n, w=warps, st=stages: launch_decode(  # noqa: E731
                    *a, 128**-0.5, s, n, w, st
                )
                record(f"  splits={splits} tiles=({block_n},{warps},{stages})", fn, nbytes=nbytes)


def bench_placement():
    """The ragged qwen3-0.6B decode case with its blocks placed three ways in a pool as large as
    the engine's per-layer cache on an 80 GB GPU (about 39k blocks of 16 tokens): spread over
    the whole pool, packed at its start, and each sequence's blocks consecutive."""
    b, hq, hk, bs, pool = 256, 16, 8, 16, 39_000
    gen = torch.Generator().manual_seed(0)
    ctx = sorted(torch.randint(100, 2049, (b,), generator=gen).tolist(), reverse=True)
    per_seq = [-(-c // bs) for c in ctx]
    width = -(-max(per_seq) // 16) * 16
    k_cache = torch.randn(pool, bs, hk, 128, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, hq, 128, device=DEV, dtype=BF16)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    nbytes = 2 * sum(ctx) * hk * 128 * 2
    need = sum(per_seq)
    for mode, ids in (
        ("pool-random", torch.randperm(pool, generator=gen)[:need]),
        ("packed-random", torch.randperm(need, generator=gen)),
        ("per-seq consecutive", torch.arange(need)),
    ):
        tables = torch.zeros(b, width, dtype=torch.int32)
        at = 0
        for i, n in enumerate(per_seq):
            tables[i, :n] = ids[at : at + n]
            at += n
        args = (q, k_cache, v_cache, lens, tables.to(DEV))
        record(f"decode B=256 ragged qwen, {mode}",
               lambda a=args: paged_attention_decode(*a, 128**-0.5, max_seq_len=max(ctx)),
               nbytes=nbytes)  # fmt: skip


def bench_read_ceiling():
    """What HBM reads alone reach (the decode kernels only read): reductions over 4 GiB."""
    x = torch.randn(2 << 30, device=DEV, dtype=BF16)
    record("read: x.sum() 4 GiB bf16", lambda: x.sum(), nbytes=x.numel() * 2)
    record("read: x.amax() 4 GiB bf16", lambda: x.amax(), nbytes=x.numel() * 2)
    y = torch.empty_like(x[: 1 << 30])
    record("copy: 2 GiB bf16 (read + write)", lambda: y.copy_(x[: 1 << 30]),
           nbytes=2 * y.numel() * 2)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="also time attention tile variants")
    parser.add_argument(
        "--only",
        choices=["elementwise", "prefill", "decode", "ragged", "placement", "read"],
        default=None,
    )
    opts = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if opts.only in (None, "elementwise"):
        bench_elementwise()
    if opts.only in (None, "prefill"):
        bench_prefill(opts.tune)
    if opts.only in (None, "decode"):
        bench_decode(opts.tune)
    if opts.only in (None, "decode", "ragged"):
        bench_ragged_decode(opts.tune)
    if opts.only in (None, "read"):
        bench_read_ceiling()
    if opts.only in (None, "placement"):
        bench_placement()
    print(f"\n{'kernel':<48} {'triton ms':>10} {'ref ms':>10} {'speed-up':>9}  achieved")
    for name, ms, ref_ms, rate in ROWS:
        ref = f"{ref_ms:10.4f}" if ref_ms is not None else f"{'':>10}"
        up = f"{ref_ms / ms:8.1f}x" if ref_ms is not None else f"{'':>9}"
        print(f"{name:<48} {ms:10.4f} {ref} {up}  {rate}")


if __name__ == "__main__":
    main()
