"""Token-to-expert alignment for the fused MoE GEMMs: the (token, slot) pairs of a routed batch
sorted by expert, each expert's run padded to the GEMM's block of rows; Triton kernel and
reference.

A routed batch of T tokens with top-k experts each has T * K pairs, pair p = t * K + k sending
token t to expert topk_ids[t, k]. The grouped GEMM runs one block of BLOCK_M rows per program,
all of one expert, so the pairs are laid out expert by expert (in pair order within an expert,
so the layout is deterministic), each expert's run padded up to a multiple of BLOCK_M with the
sentinel T * K (a row the GEMMs skip). Experts that receive no pair get no block.

Sizes are fixed by (T, K, E, BLOCK_M) alone, never by the routing, so the kernel and the GEMMs
after it run inside CUDA graphs: at most min(E, T * K) experts are non-empty, each wasting at
most BLOCK_M - 1 rows, so padded_capacity rows always hold the layout; blocks past the used
ones carry expert -1 and the GEMM programs that would take them return at once.
"""

from __future__ import annotations

import torch

from .launch import check_launchable, pow2, tl, triton

# Pairs each loop iteration of the kernel reads.
_BLOCK = 1024


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted layout may need for num_pairs pairs: every pair, plus the padding of at
    most min(num_experts, num_pairs) non-empty experts, rounded up to whole blocks."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # vary with the token count
def _moe_align_kernel(
    topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, touched_ptr, slots_ptr,
    num_pairs, num_experts, top_k, num_blocks,
    E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):  # fmt: skip
    # Program e places expert e's pairs. Pass 1 counts every expert's pairs (a histogram, which
    # every program recomputes: cheaper than another launch) for the start of e's run; pass 2
    # writes e's pairs there in pair order, then its padding and its blocks' expert id.
    e = tl.program_id(0)
    counts = tl.zeros([E_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        # Masked lanes land in bin num_experts (E_BINS > num_experts), dropped below.
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=num_experts)
        counts += tl.histogram(ids.to(tl.int32), E_BINS)
    bins = tl.arange(0, E_BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_BINS] rows of each run
    first = tl.sum(tl.where(bins < e, padded, 0))  # e's run starts after the runs before it
    count = tl.sum(tl.where(bins == e, counts, 0))
    rows = tl.sum(tl.where(bins == e, padded, 0))
    seen = tl.sum(tl.zeros([1], dtype=tl.int32))  # e's pairs written so far
    real = tl.sum(tl.zeros([1], dtype=tl.int32))  # of those, pairs of real tokens (COUNT)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = first + seen + tl.cumsum(hit, 0) - 1
        tl.store(sorted_ids_ptr + pos, offs.to(tl.int32), mask=hit != 0)
        seen += tl.sum(hit)
        if COUNT:
            if HAS_SLOTS:
                # A token whose KV slot is -1 is padding (a CUDA graph's spare rows).
                slot = tl.load(slots_ptr + offs // top_k, mask=hit != 0, other=-1)
                real += tl.sum(tl.where(slot >= 0, hit, 0))
            else:
                real += tl.sum(hit)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + first + count + pad, num_pairs, mask=pad < rows - count)
    for b in range(first // BLOCK_M, (first + rows) // BLOCK_M, BLOCK):
        blocks = b + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + blocks, e, mask=blocks < (first + rows) // BLOCK_M)
    if e == num_experts - 1:
        total = tl.sum(padded)
        tl.store(num_padded_ptr, total)
        for b in range(total // BLOCK_M, num_blocks, BLOCK):
            blocks = b + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + blocks, -1, mask=blocks < num_blocks)
    if COUNT:
        tl.atomic_add(touched_ptr, (real > 0).to(tl.int64))


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"moe_align: topk_ids must be [T, K] int32/int64, got {tuple(topk_ids.shape)} "
            f"{topk_ids.dtype}"
        )
    if not topk_ids.is_contiguous():
        raise ValueError("moe_align: topk_ids must be contiguous")
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(
            f"moe_align: need num_experts >= 1 and a power-of-two block_m, got {num_experts}, "
            f"{block_m}"
        )


def _check_counter(touched: torch.Tensor | None, token_slots: torch.Tensor | None, T: int):
    if touched is not None and (touched.dtype != torch.int64 or touched.numel() != 1):
        raise ValueError("moe_align: touched must be a one-element int64 counter")
    if token_slots is not None and (token_slots.dim() != 1 or token_slots.shape[0] < T):
        raise ValueError(f"moe_align: token_slots must be [>= {T}], got {token_slots.shape}")


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the pairs of topk_ids by expert, runs padded to block_m rows; Triton kernel.

    Args:
        topk_ids: [T, K] int32/int64, contiguous, values in [0, num_experts).
        num_experts: E.
        block_m: the GEMM's rows per program (a power of two).
        touched: optional one-element int64 counter; 1 is added for every expert that receives
            a pair of a real token (instrumentation for the benchmark's roofline).
        token_slots: optional [>= T] KV slots of the tokens; a token with slot < 0 is padding
            and is not counted in `touched` (None: every token is real).

    Returns:
        sorted_ids: [padded_capacity] int32, pair indices expert by expert, padding T * K;
            entries past num_padded are unspecified.
        expert_ids: [padded_capacity / block_m] int32, each block's expert, -1 past the end.
        num_padded: [1] int32, the rows in use (a multiple of block_m).
    """
    _check(topk_ids, num_experts, block_m)
    T, K = topk_ids.shape
    _check_counter(touched, token_slots, T)
    check_launchable("moe_align", topk_ids, *[t for t in (touched, token_slots) if t is not None])
    device = topk_ids.device
    capacity = padded_capacity(T * K, num_experts, block_m)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    if T * K == 0:
        return sorted_ids, expert_ids, num_padded
    count = touched is not None
    _moe_align_kernel[(num_experts,)](
        topk_ids, sorted_ids, expert_ids, num_padded, touched if count else num_padded,
        token_slots if token_slots is not None else topk_ids,
        T * K, num_experts, K, capacity // block_m,
        E_BINS=pow2(num_experts + 1), BLOCK_M=block_m, BLOCK=_BLOCK, COUNT=count,
        HAS_SLOTS=token_slots is not None,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_padded


def moe_align_ref(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of moe_align (same layout; unused tail entries: padding and -1)."""
    _check(topk_ids, num_experts, block_m)
    T, K = topk_ids.shape
    _check_counter(touched, token_slots, T)
    device = topk_ids.device
    capacity = padded_capacity(T * K, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), T * K, dtype=torch.int32, device=device)
    expert_ids = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=device)
    order = torch.sort(flat, stable=True).indices  # pairs expert by expert, in pair order
    start = 0
    for e, (n, rows) in enumerate(zip(counts.tolist(), padded.tolist())):
        taken = int(counts[:e].sum())
        sorted_ids[start : start + n] = order[taken : taken + n].to(torch.int32)
        expert_ids[start // block_m : (start + rows) // block_m] = e
        start += rows
    num_padded = torch.tensor([start], dtype=torch.int32, device=device)
    if touched is not None:
        count_touched_ref(topk_ids, num_experts, touched, token_slots)
    return sorted_ids, expert_ids, num_padded


def count_touched_ref(
    topk_ids: torch.Tensor,
    num_experts: int,
    touched: torch.Tensor,
    token_slots: torch.Tensor | None = None,
) -> None:
    """touched += the experts that real tokens (slot >= 0, or all without token_slots) of
    topk_ids [T, K] are routed to; what moe_align counts, in torch."""
    T = topk_ids.shape[0]
    real = torch.ones(T, dtype=torch.bool, device=topk_ids.device)
    if token_slots is not None:
        real = token_slots[:T] >= 0
    hit = torch.zeros(num_experts, dtype=torch.bool, device=topk_ids.device)
    hit[topk_ids[real].reshape(-1).long()] = True
    touched += hit.sum()
