"""Decode attention (one new token per sequence) over the paged cache: split-KV flash-decoding
Triton kernels with GQA packing, and the torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import (
    check_caches,
    check_dtype,
    check_launchable,
    check_out,
    interpreting,
    num_sms,
    pow2,
    tl,
    triton,
)
from .paged_attention import causal_attention_ref, gather_kv_ref

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32
# A split should cover at least this many keys, or the reduce costs more than it saves.
_MIN_KEYS_PER_SPLIT = 256
# A DecodePlan's units fill the GPU this many times over; the split kernel fits this many
# programs on an SM (H100: 124-128 registers a thread at 4 warps, 39 KB of shared memory).
_PLAN_WAVES = 3
_PROGRAMS_PER_SM = 4
# A planned split's keys are a multiple of this (the kernel's key tile).
_PLAN_KEY_STEP = 64
# Launch order of the split kernel's programs: kv heads of one sequence side by side.
HEADS_FIRST = True


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, part_acc_ptr, part_lse_ptr,
    unit_seq_ptr, seq_start_ptr, seq_splits_ptr,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    qk_scale, NUM_SPLITS,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr, PLAN: tl.constexpr,
):  # fmt: skip
    # Grid (Hk, units), or (units, Hk) without HEADS_FIRST; with HEADS_FIRST the programs
    # running side by side read the neighbouring kv heads of the same cache slots (a slot holds
    # all Hk heads contiguously). A unit is one split of one sequence's keys: sequence b's
    # splits are units seq_start[b] .. seq_start[b] + seq_splits[b] - 1 and divide its keys
    # equally. PLAN: the tables come from a DecodePlan (splits per sequence, balanced over the
    # batch; unit_seq[u] < 0 marks a unit past the plan's, which returns at once); otherwise
    # every sequence has NUM_SPLITS units, u = b * NUM_SPLITS + split.
    # A program takes the GROUP q heads of kv head `kvh`, packed as the rows of one
    # [BLOCK_G, D] tile so each K/V tile is read once for the group, over its unit's keys. A
    # sequence with one split writes the output; otherwise a normalised partial and its
    # log2-sum-exp go to part_acc [units, Hq, D] / part_lse [units, Hq] for the reduce kernel.
    # NUM_SPLITS is a runtime value: the split count varies with the batch, and a compile per
    # count would land in the middle of a run.
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        u = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        u = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    if PLAN:
        b = tl.load(unit_seq_ptr + u)
        if b < 0:
            return
        num_splits = tl.load(seq_splits_ptr + b)
        split = u - tl.load(seq_start_ptr + b)
    else:
        b = u // NUM_SPLITS
        num_splits = NUM_SPLITS
        split = u % NUM_SPLITS
    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
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
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if num_splits == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        # seq_len 0 (a padding row) has l_i == 0 and yields zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # An empty split (short sequence) leaves l_i == 0: partial 0 with weight exp2(-inf) = 0.
        nonempty = l_i > 0
        acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = u.to(tl.int64) * (num_kv_heads * GROUP) + heads
        a_ptrs = part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=q_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, seq_start_ptr, seq_splits_ptr, stride_ob, stride_oh,
    NUM_SPLITS,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PLAN: tl.constexpr,
):  # fmt: skip
    # Grid (B, Hq): combine the partials of one (sequence, q head); with PLAN a sequence of one
    # split was written by the split kernel and is skipped.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if PLAN:
        num_splits = tl.load(seq_splits_ptr + b)
        if num_splits == 1:
            return
        first = tl.load(seq_start_ptr + b).to(tl.int64)
    else:
        num_splits = NUM_SPLITS
        first = b * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    row = (first + offs_s) * HQ + h
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
    """Splits of the key range so B * Hk * splits programs fill the GPU about twice over, each
    split covering at least _MIN_KEYS_PER_SPLIT keys. Host ints only (CUDA-graph safe)."""
    want = -(-2 * num_sms(device) // max(batch * kv_heads, 1))
    most = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
    return max(1, min(want, most, _MAX_SPLITS))


@dataclass
class DecodePlan:
    """Key splits per sequence for one decode batch, balanced over the batch (split_plan).

    Equal splits per sequence leave a mid-size batch (one or two waves of programs) waiting on
    its longest contexts; a plan instead gives each sequence splits of about the same number
    of keys, so the programs are of about one length whatever the contexts.

    Attributes:
        unit_seq: [U] int32, the sequence of each unit (one split of one sequence's keys); -1
            past the plan's units. U sizes the grid (fixed for a CUDA graph).
        seq_start: [B] int32, each sequence's first unit (its units are consecutive).
        seq_splits: [B] int32, each sequence's split count (>= 1).
    """

    unit_seq: torch.Tensor
    seq_start: torch.Tensor
    seq_splits: torch.Tensor


def plan_units(batch: int, kv_heads: int, device: torch.device) -> int:
    """Units of a plan for `batch` sequences: programs enough to fill the GPU _PLAN_WAVES times
    over at the split kernel's occupancy, and at least one per sequence. Host ints only: a
    CUDA graph sizes its grid with it. Equal to batch when the batch alone fills the GPU."""
    want = -(-_PLAN_WAVES * _PROGRAMS_PER_SM * num_sms(device) // max(kv_heads, 1))
    return max(batch, want)


def split_plan(
    seq_lens: list[int], num_units: int, min_keys: int = _MIN_KEYS_PER_SPLIT
) -> tuple[list[int], list[int], list[int]]:
    """Pure-Python bookkeeping for a DecodePlan: (unit_seq [num_units], seq_start, seq_splits).

    Every sequence's keys are cut into ceil(len / C) equal splits, with C the smallest multiple
    of _PLAN_KEY_STEP that is at least min_keys and keeps the units within num_units (and no
    sequence above _MAX_SPLITS splits). C = total / (num_units - B) always fits, since
    sum(ceil(len / C)) <= total / C + B.
    """
    batch = len(seq_lens)
    if batch > num_units:
        raise ValueError(f"split_plan: {batch} sequences need {batch} units, got {num_units}")
    total = sum(seq_lens)
    keys = max(min_keys, -(-max(seq_lens, default=0) // _MAX_SPLITS))
    if num_units > batch:
        keys = max(keys, -(-total // (num_units - batch)))
    else:
        keys = max(keys, max(seq_lens, default=1))  # one split each
    keys = -(-keys // _PLAN_KEY_STEP) * _PLAN_KEY_STEP
    splits = [max(1, -(-n // keys)) for n in seq_lens]
    starts, unit_seq = [], []
    for b, n in enumerate(splits):
        starts.append(len(unit_seq))
        unit_seq += [b] * n
    unit_seq += [-1] * (num_units - len(unit_seq))
    return unit_seq, starts, splits


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
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole paged context, Triton kernels.

    Launches only from host ints and shapes (no .item(), no sync), so it can be captured in a
    CUDA graph; allocations are the output and, when splitting, the fp32 partials.

    Args:
        q: [B, Hq, D] (bf16/fp16/fp32), last dim contiguous; token b sits at position
            seq_lens[b] - 1 and attends to all seq_lens[b] keys (a row with seq_lens[b] == 0,
            e.g. CUDA-graph padding, gets zeros).
        k_cache, v_cache: [NB, BS, Hk, D], BS a power of two, Hq % Hk == 0, q's dtype.
        seq_lens: [B] int32.
        block_tables: [B, MB] int32.
        scale: softmax scale.
        num_splits: partitions of the key range; None picks one from B, Hk and the length.
        max_seq_len: upper bound of seq_lens (host int) for that choice; None takes
            MB * BS, the most the block tables can hold.
        out: where to write the result, [B, Hq, D] in q.dtype with a contiguous last dim (a
            view into a larger buffer is fine: a mixed step's decode rows); None allocates it.
        plan: splits per sequence built from the host's context lengths (split_plan), in
            place of num_splits equal splits for every sequence.

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
    if not (k_cache.dtype == v_cache.dtype == q.dtype):
        raise ValueError(
            f"{op}: q, k_cache and v_cache dtypes differ: "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
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
    check_launchable(op, q, k_cache, v_cache, seq_lens, block_tables)
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * bs
        num_splits = choose_num_splits(B, HK, bound, q.device)
    if num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")
    if out is not None:
        check_out(op, q, out)
    if plan is not None:
        _check_plan(op, plan, B)
    return launch_decode(
        q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, *_tiles(), out=out,
        plan=plan,
    )  # fmt: skip


def _check_plan(op: str, plan: DecodePlan, batch: int) -> None:
    tables = (plan.unit_seq, plan.seq_start, plan.seq_splits)
    if any(t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() for t in tables):
        raise ValueError(f"{op}: the plan's tables must be contiguous 1-D int32 tensors")
    if plan.seq_start.shape[0] != batch or plan.seq_splits.shape[0] != batch:
        raise ValueError(
            f"{op}: the plan covers {plan.seq_start.shape[0]} sequences, the batch has {batch}"
        )
    if plan.unit_seq.shape[0] < batch:
        raise ValueError(f"{op}: a plan needs at least one unit per sequence ({batch})")


def _tiles() -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel."""
    if interpreting():
        return 16, 4, 1
    return 64, 4, 3


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
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Launch the split and reduce kernels on checked arguments with explicit tiles (tests,
    benchmarks); out: a checked [B, Hq, D] to write, or None to allocate one; plan: the
    splits per sequence (num_splits is then unused). paged_attention_decode is the entry
    point."""
    B, HQ, D = q.shape
    bs, HK = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty((B, HQ, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = HQ // HK
    if plan is not None:
        units = plan.unit_seq.shape[0]
        split_tables = (plan.unit_seq, plan.seq_start, plan.seq_splits)
        reduce = True  # the reduce's programs return at once for sequences of one split
    else:
        units = B * num_splits
        split_tables = (seq_lens, seq_lens, seq_lens)  # unread without a plan
        reduce = num_splits > 1
    if reduce:
        part_acc = torch.empty((units, HQ, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((units, HQ), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = out
    grid = (HK, units) if heads_first else (units, HK)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, seq_lens, block_tables, out, part_acc, part_lse, *split_tables,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * _LOG2E, num_splits,
        GROUP=group, BLOCK_G=max(16, pow2(group)), HEAD_DIM=D, BLOCK_D=pow2(D),
        BLOCK_N=block_n, PAGE_SIZE=bs,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEADS_FIRST=heads_first,
        PLAN=plan is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if reduce:
        _decode_reduce_kernel[(B, HQ)](
            part_acc, part_lse, out, *split_tables[1:], out.stride(0), out.stride(1),
            num_splits, HQ=HQ, HEAD_DIM=D, BLOCK_D=pow2(D),
            BLOCK_S=pow2(max(num_splits, _MAX_SPLITS)), PLAN=plan is not None,
            num_warps=4 if D >= 128 else 2,
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
) -> torch.Tensor:
    """Torch reference of paged_attention_decode (num_splits / max_seq_len are ignored); writes
    into out when given."""
    if out is None:
        out = torch.zeros_like(q)
    else:
        check_out("paged_attention_decode", q, out)
        out.zero_()
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len)
        v = gather_kv_ref(v_cache, block_tables[b], seq_len)
        out[b] = causal_attention_ref(q[b : b + 1], k, v, scale)[0]
    return out
