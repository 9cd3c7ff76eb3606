"""Fused mixture-of-experts MLP: grouped GEMMs over stacked expert weights; Triton kernels and the
torch reference (a loop over experts, as transformers runs it).

For hidden [T, H], experts w13 [E, 2I, H] (gate rows, then up rows, per expert) and w2
[E, H, I], and a routing of each token to K experts (topk_ids, topk_weights [T, K]):

    out[t] = sum_k  w_tk * down_e(silu(gate_e(x_t)) * up_e(x_t)),   e = topk_ids[t, k]

1. moe_align lays the T * K pairs out expert by expert in blocks of BLOCK_M rows.
2. gate_up: each program takes one block (one expert) and BLOCK_N columns, gathers the block's
   token rows of hidden, multiplies by that expert's w13 rows, and (fuse_activation) applies
   SiLU-and-mul in the epilogue from two accumulators (gate columns j, up columns I + j),
   writing act [T * K, I] at the pairs' rows; unfused, it writes [T * K, 2I] and silu_and_mul
   runs after it.
3. down: the same over act with w2, each row scaled by its routing weight in the epilogue,
   written to [T * K, H].
4. moe_sum adds each token's K rows in a fixed order (float32), so results do not depend on
   scheduling (no atomics).

Roundings follow transformers' expert loop: the projections' outputs are rounded to the
dtype, silu(gate) is rounded before the product with up, and the down output is rounded before
the routing weight (float32 or rounded, as the router gives it) scales it; only the sum over
the K experts is taken in float32 once instead of in the dtype expert by expert.

Every size is fixed by T, K, E and the tiles, so the whole op runs inside CUDA graphs: grids
cover padded_capacity rows and programs past the used blocks return at once.
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul
from .fused_moe_tiles import TOKEN_BUCKETS, GemmTile, MoeTiles, tile_config
from .launch import check_dtype, check_launchable, tl, triton
from .moe_align import moe_align

_SUM_BLOCK = 1024


@triton.jit
def tile_of(pid, N, num_m_blocks, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Program pid -> (row block, column block): GROUP_M row blocks side by side per column
    # block, so the experts' weight tiles are reused from L2.
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows


@triton.jit
def store_rows(acc, acc_up, c_ptr, weights_ptr, pair, valid, cols, col_ok, stride_cm,
               SILU: tl.constexpr, MUL_WEIGHTS: tl.constexpr):  # fmt: skip
    # The epilogue: fp32 products [BM, BN] (gate and up with SILU) -> c's rows `pair`, rounded
    # as transformers' expert loop rounds (module docstring).
    dtype = c_ptr.dtype.element_ty
    out = acc
    if SILU:
        # Rounded as silu(gate) * up on the rounded projections.
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = act * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHTS:
        route = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        out = out.to(dtype).to(tl.float32) * route[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, out.to(dtype), mask=valid[:, None] & col_ok[None, :])


# Arguments that change with the token count are not specialized on: one compiled kernel per
# tile configuration serves every batch (warm_up compiles them all before a run).
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, num_m_blocks, up_offset,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr, SILU: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # c[pair, n] = a[pair // A_ROWS_PER_TOKEN] . w[expert(pair), n] over K, for the BLOCK_M
    # pairs of block pid_m (one expert) and BLOCK_N columns. Program order: GROUP_M row blocks
    # side by side per column block, so the experts' weight tiles are reused from L2.
    pid_m, pid_n = tile_of(tl.program_id(0), N, num_m_blocks, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pair < num_pairs  # padding rows hold num_pairs
    a_rows = (pair // A_ROWS_PER_TOKEN).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                           other=0.0)  # fmt: skip
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    store_rows(acc, acc_up, c_ptr, weights_ptr, pair, valid, cols, col_ok, stride_cm, SILU,
               MUL_WEIGHTS)  # fmt: skip


@triton.jit
def _moe_sum_kernel(x_ptr, out_ptr, H, stride_x, stride_out, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    # out[t] = sum over k of x[t * TOP_K + k], in float32, k in order.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + k) * stride_x + cols, mask=mask, other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weight_dtype: torch.dtype | None = None,
) -> None:
    """Shapes and dtypes of a fused MoE call (see fused_moe); the weights in weight_dtype
    (None: hidden's dtype)."""
    op = "fused_moe"
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{op}: need hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
            f"{tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    if w13.shape[2] != H or two_i % 2 or tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"{op}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden "
            f"{tuple(hidden.shape)} (want [E, 2I, {H}] and [E, {H}, I])"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"{op}: topk_ids and topk_weights must both be [{T}, K], got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"{op}: topk_ids must be int32/int64 and topk_weights floating")
    want = weight_dtype or hidden.dtype
    if w13.dtype != want or w2.dtype != want:
        raise ValueError(f"{op}: weights ({w13.dtype}, {w2.dtype}) must be {want}")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: MoeTiles | None = None,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' MLP of every token, summed with the routing weights; Triton kernels.

    Args:
        hidden: [T, H] (bf16/fp16/fp32), rows contiguous.
        w13: [E, 2I, H], each expert's gate rows then up rows, contiguous.
        w2: [E, H, I], contiguous.
        topk_weights: [T, K] float (float32 or hidden's dtype), contiguous.
        topk_ids: [T, K] int32/int64 in [0, E), contiguous.
        tiles: the GEMMs' tiles (None: fused_moe_tiles.tile_config for this shape).
        touched, token_slots: expert-use instrumentation, see moe_align.

    Returns:
        [T, H] in hidden's dtype.
    """
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    op = "fused_moe"
    check_dtype(op, "hidden", hidden)
    if hidden.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"{op}: hidden rows and the expert weights must be contiguous")
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    check_launchable(op, hidden, w13, w2, topk_weights, topk_ids)
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    out = torch.empty_like(hidden)
    if T == 0:
        return out
    if tiles is None:
        dtype_name = str(hidden.dtype).removeprefix("torch.")
        tiles = tile_config(T, E, H, inter, top_k, dtype_name, hidden.element_size())
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, tiles.block_m, touched, token_slots)
    layout = (sorted_ids, expert_ids, num_padded, T * top_k)
    pairs = T * top_k
    if tiles.fuse_activation:
        act = hidden.new_empty(pairs, inter)
        _gemm(hidden, w13, act, None, layout, inter, top_k, True, tiles.block_m, tiles.gate_up)
    else:
        gate_up = hidden.new_empty(pairs, two_i)
        _gemm(hidden, w13, gate_up, None, layout, two_i, top_k, False, tiles.block_m,
              tiles.gate_up)  # fmt: skip
        act = silu_and_mul(gate_up)
    down = hidden.new_empty(pairs, H)
    _gemm(act, w2, down, topk_weights, layout, H, 1, False, tiles.block_m, tiles.down)
    grid = (T, triton.cdiv(H, _SUM_BLOCK))
    _moe_sum_kernel[grid](down, out, H, down.stride(0), out.stride(0), TOP_K=top_k,
                          BLOCK=_SUM_BLOCK)  # fmt: skip
    return out


def _gemm(a, w, c, weights, layout, n_out, rows_per_token, silu, block_m, tile: GemmTile):
    """One grouped GEMM launch: c [pairs, n_out] from a's rows and w [E, N, K] (see the
    kernel); weights [T, K] scale each row when given."""
    sorted_ids, expert_ids, num_padded, num_pairs = layout
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n_out, tile.block_n),)
    _expert_gemm_kernel[grid](
        a, w, c, weights if weights is not None else a, sorted_ids, expert_ids, num_padded,
        n_out, w.shape[2], num_pairs, num_m_blocks, n_out if silu else 0,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, SILU=silu, MUL_WEIGHTS=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def warm_up_calls(w13: torch.Tensor, top_k: int, dtype, weights_dtype, dtype_name, itemsize,
                  call) -> int:  # fmt: skip
    """Call call(hidden, weights, ids, tiles, touched, token_slots) on zero inputs of `dtype`
    once for each distinct tile configuration the experts w13 [E, 2I, H] get at any token count
    (tiles keyed by dtype_name / itemsize), without and with the expert-use counter; returns
    the number of configurations. Triton compiles a kernel at its first launch, which a step of
    a new size would otherwise pay mid-run."""
    E, two_i, H = w13.shape
    scratch = torch.zeros(1, dtype=torch.int64, device=w13.device)  # a counter nobody reads
    seen = set()
    for bucket in TOKEN_BUCKETS:
        tiles = tile_config(bucket, E, H, two_i // 2, top_k, dtype_name, itemsize)
        if tiles in seen:
            continue
        seen.add(tiles)
        hidden = torch.zeros(bucket, H, dtype=dtype, device=w13.device)
        # Pair p = t * K + k to expert p mod E: distinct experts within a token (K <= E).
        ids = (torch.arange(bucket * top_k, device=w13.device) % E).view(bucket, top_k)
        weights = torch.full((bucket, top_k), 1.0 / top_k, dtype=weights_dtype, device=w13.device)
        slots = torch.zeros(bucket, dtype=torch.int64, device=w13.device)
        for touched, token_slots in ((None, None), (scratch, None), (scratch, slots)):
            call(hidden, weights, ids.to(torch.int32), tiles, touched, token_slots)
    return len(seen)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> int:
    """Compile every tile configuration fused_moe picks for these weights, whatever the token
    count (warm_up_calls); returns the number of configurations run."""

    def call(hidden, weights, ids, tiles, touched, token_slots):
        fused_moe(hidden, w13, w2, weights, ids, tiles, touched, token_slots)

    dtype_name = str(w13.dtype).removeprefix("torch.")
    return warm_up_calls(w13, top_k, w13.dtype, weights_dtype, dtype_name, w13.element_size(),
                         call)  # fmt: skip


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of fused_moe: a loop over the experts that receive tokens, in the
    roundings of transformers' expert loop, the K outputs of a token summed in float32."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    T, H = hidden.shape
    inter, top_k = w13.shape[1] // 2, topk_ids.shape[1]
    rows = hidden.new_zeros(T, top_k, H)  # each pair's weighted expert output
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        gate, up = torch.nn.functional.linear(hidden[token], w13[e]).split(inter, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])  # [n, H]
        rows[token, slot] = (y.float() * topk_weights[token, slot, None].float()).to(y.dtype)
    out = rows[:, 0].to(torch.float32, copy=True)  # [T, H], contiguous (not a view of rows)
    for k in range(1, top_k):  # the kernel's order
        out += rows[:, k].float()
    return out.to(hidden.dtype)
