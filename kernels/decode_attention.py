"""Decode attention (one new token per sequence) over the paged cache (bf16/fp16/fp32, or FP8
e4m3 dequantized with per-layer scales): split-KV flash-decoding Triton kernels with GQA
packing, and the torch reference."""

from __future__ import annotations

import torch

from .fp8 import check_kv_cache_dtype
from .launch import (
    check_caches,
    check_dtype,
    check_launchable,
    check_out,
    interpreting,
    num_sms,
    pdl_prologue,
    pow2,
    tl,
    triton,
    use_pdl,
)
from .paged_attention import causal_attention_ref, gather_kv_ref

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
# Splits are chosen so B * Hk * splits programs number about this many times the SMs (1 and 4
# tied with 2 in a llama3.1-8b nano sweep with the 128-key tiles).
SPLIT_FILL = 2
# A split should cover at least this many keys, or the reduce costs more than it saves.
_MIN_KEYS_PER_SPLIT = 256
# The split kernel's key rows per tile, warps and software-pipeline stages on a GPU. 128-key
# tiles in 2 stages beat 64 x 3 by 0.3-0.5% in llama3.1-8b nano runs (H100, same-call sweeps,
# 2026-11-23, 6d7449c); 8 warps, 32-key tiles and 2 warps lost.
DECODE_BLOCK_N = 128
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
# Launch order of the split kernel's programs: kv heads of one sequence side by side.
HEADS_FIRST = True


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, part_acc_ptr, part_lse_ptr,
    kv_scale_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    qk_scale, NUM_SPLITS,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Grid (B, Hk, NUM_SPLITS), or (Hk, B, NUM_SPLITS) with HEADS_FIRST so that programs
    # running side by side read the neighbouring kv heads of the same cache slots (a slot holds
    # all Hk heads contiguously). The GROUP q heads of kv head `kvh` of sequence b, packed as the
    # rows of one [BLOCK_G, D] tile so each K/V tile is read once for the group, over one split
    # of the keys. NUM_SPLITS == 1 writes the output; otherwise a normalised partial and its
    # log2-sum-exp go to part_acc [B, Hq, S, D] / part_lse [B, Hq, S] for the reduce kernel.
    # NUM_SPLITS is a runtime value: the split count varies with the batch, and a compile per
    # count would land in the middle of a run. KV_FP8: the caches are e4m3, widened exactly to
    # q's dtype per tile; k_scale joins qk_scale and v_scale multiplies the output (or partial).
    pdl_prologue(USE_PDL)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    n_lo = split * tiles_per_split * BLOCK_N
    n_hi = tl.minimum(n_lo + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = k_base + (blk * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (blk * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        # seq_len 0 (a padding row) has l_i == 0 and yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            out = out * tl.load(kv_scale_ptr + 1)
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # An empty split (short sequence) leaves l_i == 0: partial 0 with weight exp2(-inf) = 0.
        nonempty = l_i > 0
        acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if KV_FP8:
            acc = acc * tl.load(kv_scale_ptr + 1)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (b.to(tl.int64) * (num_kv_heads * GROUP) + heads) * NUM_SPLITS + split
        a_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=q_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, NUM_SPLITS,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Grid (B, Hq): combine the NUM_SPLITS partials of one (sequence, q head).
    pdl_prologue(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (b * HQ + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all 0 when seq_len == 0
    part = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of the key range so B * Hk * splits programs fill the GPU about SPLIT_FILL times
    over, each split covering at least _MIN_KEYS_PER_SPLIT keys. Host ints only (CUDA-graph
    safe)."""
    want = -(-SPLIT_FILL * num_sms(device) // max(batch * kv_heads, 1))
    most = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
    return max(1, min(want, most, _MAX_SPLITS))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole paged context, Triton kernels.

    Launches only from host ints and shapes (no .item(), no sync), so it can be captured in a
    CUDA graph; allocations are the output and, when splitting, the fp32 partials.

    Args:
        q: [B, Hq, D] (bf16/fp16/fp32), last dim contiguous; token b sits at position
            seq_lens[b] - 1 and attends to all seq_lens[b] keys (a row with seq_lens[b] == 0,
            e.g. CUDA-graph padding, gets zeros).
        k_cache, v_cache: [NB, BS, Hk, D], BS a power of two, Hq % Hk == 0, q's dtype or
            float8_e4m3fn (then read as float(k) * k_scale, float(v) * v_scale).
        seq_lens: [B] int32.
        block_tables: [B, MB] int32.
        scale: softmax scale.
        num_splits: partitions of the key range; None picks one from B, Hk and the length.
        max_seq_len: upper bound of seq_lens (host int) for that choice; None takes
            MB * BS, the most the block tables can hold.
        out: where to write the result, [B, Hq, D] in q.dtype with a contiguous last dim (a
            view into a larger buffer is fine: a mixed step's decode rows); None allocates it.
        kv_scale: FP8 caches only: [2] float32 (k_scale, v_scale).

    Returns:
        out, [B, Hq, D] in q.dtype.
    """
    op = "paged_attention_decode"
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [B, Hq, D], got {tuple(q.shape)}")
    check_caches(op, k_cache, v_cache)
    B, HQ, D = q.shape
    _, bs, HK, _ = k_cache.shape
    if k_cache.shape[3] != D:
        raise ValueError(f"{op}: q head_dim {D} != cache head_dim {k_cache.shape[3]}")
    if HQ % HK != 0:
        raise ValueError(f"{op}: Hq={HQ} is not a multiple of Hk={HK}")
    if bs & (bs - 1) != 0:
        raise ValueError(f"{op}: cache block size {bs} must be a power of two")
    if not (q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1):
        raise ValueError(f"{op}: q and caches need a contiguous last dim")
    fp8 = check_kv_cache_dtype(op, q.dtype, k_cache, v_cache, kv_scale)
    check_dtype(op, "q", q)
    if not (seq_lens.shape == (B,) and seq_lens.dtype == torch.int32):
        raise ValueError(
            f"{op}: seq_lens must be [{B}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if not (
        block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.dtype == torch.int32
    ):
        raise ValueError(
            f"{op}: block_tables must be [{B}, MB] int32, "
            f"got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if not (block_tables.stride(1) == 1 and seq_lens.is_contiguous()):
        raise ValueError(f"{op}: seq_lens and block_tables rows must be contiguous")
    check_launchable(op, q, k_cache, v_cache, seq_lens, block_tables, *([kv_scale] if fp8 else []))
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * bs
        num_splits = choose_num_splits(B, HK, bound, q.device)
    if num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")
    if out is not None:
        check_out(op, q, out)
    return launch_decode(
        q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, *_tiles(), out=out,
        kv_scale=kv_scale,
    )  # fmt: skip


def _tiles() -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel."""
    if interpreting():
        return 16, 4, 1
    return DECODE_BLOCK_N, DECODE_NUM_WARPS, DECODE_NUM_STAGES


def launch_decode(
    q,
    k_cache,
    v_cache,
    seq_lens,
    block_tables,
    scale,
    num_splits,
    block_n,
    num_warps,
    num_stages,
    heads_first: bool = HEADS_FIRST,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the split and reduce kernels on checked arguments with explicit tiles (tests,
    benchmarks); out: a checked [B, Hq, D] to write, or None to allocate one; kv_scale: [2]
    float32 for FP8 caches, else None; paged_attention_decode is the entry point."""
    B, HQ, D = q.shape
    bs, HK = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty((B, HQ, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = HQ // HK
    if num_splits > 1:
        part_acc = torch.empty((B, HQ, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, HQ, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = out
    grid = (HK, B, num_splits) if heads_first else (B, HK, num_splits)
    pdl = use_pdl(q.device)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, seq_lens, block_tables, out, part_acc, part_lse,
        kv_scale if kv_scale is not None else seq_lens,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, num_splits,
        GROUP=group, BLOCK_G=max(16, pow2(group)), HEAD_DIM=D, BLOCK_D=pow2(D),
        BLOCK_N=block_n, PAGE_SIZE=bs,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEADS_FIRST=heads_first,
        KV_FP8=kv_scale is not None, USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(B, HQ)](
            part_acc, part_lse, out, out.stride(0), out.stride(1), num_splits,
            HQ=HQ, HEAD_DIM=D, BLOCK_D=pow2(D), BLOCK_S=pow2(max(num_splits, _MAX_SPLITS)),
            USE_PDL=pdl, num_warps=4 if D >= 128 else 2, launch_pdl=pdl,
        )  # fmt: skip
    return out


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of paged_attention_decode (num_splits / max_seq_len are ignored; FP8
    caches dequantized to float32); writes into out when given."""
    fp8 = check_kv_cache_dtype("paged_attention_decode", q.dtype, k_cache, v_cache, kv_scale)
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if fp8 else (None, None)
    if out is None:
        out = torch.zeros_like(q)
    else:
        check_out("paged_attention_decode", q, out)
        out.zero_()
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len, k_scale)
        v = gather_kv_ref(v_cache, block_tables[b], seq_len, v_scale)
        out[b] = causal_attention_ref(q[b : b + 1], k, v, scale)[0]
    return out
