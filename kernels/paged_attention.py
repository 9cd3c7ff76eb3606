"""Causal attention over a ragged batch (prefill, chunked prefill, mixed), reading K/V from the
paged cache (bf16/fp16/fp32, or FP8 e4m3 dequantized with per-layer scales) or from contiguous
per-sequence K/V: Triton flash-attention kernel and references."""

from __future__ import annotations

import torch

from .fp8 import check_kv_cache_dtype, dequantize_fp8_ref
from .launch import (
    check_caches,
    check_dtype,
    check_launchable,
    check_out,
    interpreting,
    pow2,
    tl,
    triton,
)

_LOG2E = 1.4426950408889634
# Query rows per program (at most) and warps of the kernel on a GPU, for head_dim <= 128.
PREFILL_BLOCK_M = 64
PREFILL_NUM_WARPS = 4
# Key rows per tile and software-pipeline stages of the kernel on a GPU, for head_dim <= 128.
PREFILL_BLOCK_N = 64
PREFILL_NUM_STAGES = 3


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, q_start,
    n_lo, n_hi, seq_len,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    # Online softmax over key tiles [n_lo, n_hi); q is [BLOCK_M, BLOCK_D], scores in log2 units.
    # KV_FP8: K/V tiles are e4m3, widened exactly to q's dtype (their scales are applied by the
    # caller: k_scale inside qk_scale, v_scale to the output).
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start_n in range(n_lo, n_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        if PAGED:
            # Key n lives in cache block bt_row[n // PAGE_SIZE], slot n % PAGE_SIZE.
            blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            k_rows = blk * stride_kb + (offs_n % PAGE_SIZE) * stride_ks
            v_rows = blk * stride_vb + (offs_n % PAGE_SIZE) * stride_vs
        else:
            k_rows = (q_start + offs_n).to(tl.int64) * stride_ks
            v_rows = (q_start + offs_n).to(tl.int64) * stride_vs
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL_MASK:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    # Grid (cdiv(max_seqlen_q, BLOCK_M), Hq, B): BLOCK_M new tokens of one sequence, one q head.
    # Query blocks run last-first: the costliest (most keys) start early, the cheap fill the tail.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + b)
    else:
        seq_len = q_len
    # The new tokens are the last q_len of the context: query i sits at position ctx + i.
    ctx = seq_len - q_len
    kvh = h // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask)
    q_pos = ctx + offs_m

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if KV_FP8:  # q . (k_scale k) = k_scale (q . k); p @ (v_scale v) = v_scale (p @ v)
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    # Keys before the tile's first query position are visible to every row: no mask there.
    n_full = ((ctx + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(seq_len, ctx + (m_block + 1) * BLOCK_M)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, q_start, 0, n_full, seq_len,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, False, PRECISION, KV_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_base, v_base, bt_row, q_pos, q_start, n_full, n_end, seq_len,
        stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, True, PRECISION, KV_FP8,
    )  # fmt: skip
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * v_scale
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tiles(head_dim: int, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head_dim and longest query chunk.

    Measured on an H100 (tests/kernels/bench_kernels.py --tune, bf16, D=128): 64 x 64 tiles,
    4 warps, 3 stages beat 128-row tiles with 4 or 8 warps on 2k prompts and on 128-token
    chunks over a 2k cached prefix.
    """
    if interpreting():
        return 16, 16, 4, 1
    block_m = min(PREFILL_BLOCK_M, max(16, pow2(max_seqlen_q)))
    if head_dim > 128:
        return block_m, 32, 4, 2
    return block_m, PREFILL_BLOCK_N, PREFILL_NUM_WARPS, PREFILL_NUM_STAGES


def launch_attention(
    q, k, v, cu_seqlens, seq_lens, block_tables, scale, max_seqlen_q, paged, tiles=None, out=None,
    kv_scale=None,
) -> torch.Tensor:  # fmt: skip
    """Launch the kernel on checked arguments, K/V paged ([NB, BS, Hk, D] caches) or contiguous
    ([T, Hk, D]); tiles = (BLOCK_M, BLOCK_N, num_warps, num_stages) or None for the default;
    out: a checked [T, Hq, D] to write (check_out), or None to allocate one; kv_scale: [2]
    float32 for FP8 caches, else None.
    paged_attention / varlen_attention are the entry points; this serves tests and benchmarks."""
    T, HQ, D = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    B = cu_seqlens.shape[0] - 1
    if T == 0 or B == 0:
        return out
    HK = k.shape[-2]
    block_m, block_n, num_warps, num_stages = tiles or _tiles(D, max_seqlen_q)
    if paged:
        strides_k = (k.stride(0), k.stride(1), k.stride(2))
        strides_v = (v.stride(0), v.stride(1), v.stride(2))
        page_size, stride_bt = k.shape[1], block_tables.stride(0)
    else:
        strides_k = (0, k.stride(0), k.stride(1))
        strides_v = (0, v.stride(0), v.stride(1))
        page_size, stride_bt = 1, 0
    grid = (triton.cdiv(max_seqlen_q, block_m), HQ, B)
    _attention_kernel[grid](
        q, k, v, out, cu_seqlens,
        seq_lens if paged else cu_seqlens, block_tables if paged else cu_seqlens,
        kv_scale if kv_scale is not None else cu_seqlens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *strides_k, *strides_v, stride_bt,
        scale * _LOG2E,
        GROUP=HQ // HK, HEAD_DIM=D, BLOCK_D=pow2(D), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, PAGED=paged,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_scale is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _check_q(op: str, q: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [T, Hq, D], got {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"{op}: q head_dim {q.shape[2]} != K/V head_dim {head_dim}")
    if q.shape[1] % kv_heads != 0:
        raise ValueError(f"{op}: Hq={q.shape[1]} is not a multiple of Hk={kv_heads}")
    if q.stride(2) != 1:
        raise ValueError(f"{op}: q needs a contiguous last dim, got strides {q.stride()}")
    check_dtype(op, "q", q)


def _check_meta(op: str, cu_seqlens: torch.Tensor, *int32s: torch.Tensor) -> None:
    for t in (cu_seqlens, *int32s):
        if t.dtype != torch.int32:
            raise ValueError(f"{op}: sequence metadata must be int32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: sequence metadata must be contiguous")
    if not (cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 1):
        raise ValueError(f"{op}: cu_seqlens must be [B+1]")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of new tokens over their paged context, Triton kernel.

    Sequence b's new tokens q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] sit at the last q_len_b positions
    of its seq_lens[b] context; query j attends to key positions 0 .. seq_lens[b] - q_len_b + j,
    read through block_tables[b] (their K/V are already in the cache).

    Args:
        q: [T, Hq, D] (bf16/fp16/fp32), last dim contiguous.
        k_cache, v_cache: [NB, BS, Hk, D], BS a power of two, Hq % Hk == 0, q's dtype or
            float8_e4m3fn (then read as float(k) * k_scale, float(v) * v_scale).
        cu_seqlens_q: [B+1] int32.
        seq_lens: [B] int32, context length after this step (cached + new).
        block_tables: [B, MB] int32.
        scale: softmax scale (usually D ** -0.5).
        max_seqlen_q: max q_len_b (host int; sizes the grid without a sync).
        out: where to write the result, [T, Hq, D] in q.dtype with a contiguous last dim (a
            view into a larger buffer is fine: a mixed step's rows after its decode rows);
            None allocates it.
        kv_scale: FP8 caches only: [2] float32 (k_scale, v_scale).

    Returns:
        out, [T, Hq, D] in q.dtype.
    """
    op = "paged_attention"
    check_caches(op, k_cache, v_cache)
    _check_q(op, q, k_cache.shape[2], k_cache.shape[3])
    fp8 = check_kv_cache_dtype(op, q.dtype, k_cache, v_cache, kv_scale)
    if not (k_cache.stride(3) == 1 and v_cache.stride(3) == 1):
        raise ValueError(f"{op}: caches need a contiguous last dim")
    bs = k_cache.shape[1]
    if bs & (bs - 1) != 0:
        raise ValueError(f"{op}: cache block size {bs} must be a power of two")
    _check_meta(op, cu_seqlens_q, seq_lens, block_tables)
    B = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape != (B,):
        raise ValueError(f"{op}: seq_lens must be [{B}], got {tuple(seq_lens.shape)}")
    if not (block_tables.dim() == 2 and block_tables.shape[0] == B):
        raise ValueError(f"{op}: block_tables must be [{B}, MB], got {tuple(block_tables.shape)}")
    if max_seqlen_q < 1:
        raise ValueError(f"{op}: max_seqlen_q must be >= 1, got {max_seqlen_q}")
    if out is not None:
        check_out(op, q, out)
    metadata = (cu_seqlens_q, seq_lens, block_tables)
    check_launchable(op, q, k_cache, v_cache, *metadata, *([kv_scale] if fp8 else []))
    return launch_attention(
        q, k_cache, v_cache, *metadata, scale, max_seqlen_q, True, out=out, kv_scale=kv_scale
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a ragged batch, no cache, Triton kernel.

    Args:
        q: [T, Hq, D]; k, v: [T, Hk, D] (same dtype, last dim contiguous).
        cu_seqlens: [B+1] int32 offsets of each sequence in the flat batch.
        max_seqlen: longest sequence (host int).
        scale: softmax scale.

    Returns:
        [T, Hq, D] in q.dtype.
    """
    op = "varlen_attention"
    if not (k.dim() == 3 and k.shape == v.shape):
        raise ValueError(
            f"{op}: k and v must be [T, Hk, D], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_q(op, q, k.shape[1], k.shape[2])
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: k has {k.shape[0]} tokens, q has {q.shape[0]}")
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (k.stride(2) == 1 and v.stride(2) == 1):
        raise ValueError(f"{op}: k and v need a contiguous last dim")
    _check_meta(op, cu_seqlens)
    if max_seqlen < 1:
        raise ValueError(f"{op}: max_seqlen must be >= 1, got {max_seqlen}")
    check_launchable(op, q, k, v, cu_seqlens)
    return launch_attention(q, k, v, cu_seqlens, cu_seqlens, cu_seqlens, scale, max_seqlen, False)


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D] are the last Lq of the Lk positions of k, v [Lk, Hk, D].

    Softmax in fp32 with a causal mask; returns [Lq, Hq, D] in q.dtype.
    """
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    group = hq // hk
    kf = k.float().repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [Hq, Lq, Lk]
    q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    visible = torch.arange(lk, device=q.device)[None, :] <= q_pos  # [Lq, Lk]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def gather_kv_ref(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V: [seq_len, Hk, D] from [NB, BS, Hk, D];
    with scale (FP8 caches) dequantized to float32, float(x) * scale."""
    num_blocks = -(-seq_len // cache.shape[1])
    blocks = cache[block_table[:num_blocks].long()]  # [nb, BS, Hk, D]
    out = blocks.reshape(-1, *cache.shape[2:])[:seq_len]
    return out if scale is None else dequantize_fp8_ref(out, scale)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of paged_attention: per sequence, gather K/V through the block table
    (dequantized to float32 from FP8 caches); writes into out when given."""
    fp8 = check_kv_cache_dtype("paged_attention", q.dtype, k_cache, v_cache, kv_scale)
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if fp8 else (None, None)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out("paged_attention", q, out)
    offsets = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = offsets[b], offsets[b + 1]
        if end == start:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len, k_scale)
        v = gather_kv_ref(v_cache, block_tables[b], seq_len, v_scale)
        out[start:end] = causal_attention_ref(q[start:end], k, v, scale)
    return out


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Torch reference of varlen_attention: causal attention within each sequence."""
    out = torch.empty_like(q)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end > start:
            out[start:end] = causal_attention_ref(q[start:end], k[start:end], v[start:end], scale)
    return out
