"""Fused mixture-of-experts MLP with FP8 e4m3 expert weights: fused_moe.py's grouped GEMMs with
the weights read as FP8 (half the bytes of bf16), the activations quantized as the scheme says;
Triton kernel and torch reference.

A scheme (layers/fp8_linear.py Fp8Scheme) as the checkpoint gives it, for every expert alike:
    weight "channel": w13_scale [E, 2I] (each expert's gate rows, then its up rows), w2_scale
        [E, H]; "block" (bn, bk): w13_scale [E, 2 * ceil(I / bn), ceil(H / bk)] (the gate's
        block rows, then the up's: the checkpoint's two tensors side by side, so I need not be a
        multiple of bn), w2_scale [E, ceil(H / bn), ceil(I / bk)]. w = float(q) * scale.
    activation "token" (channel weights): hidden and the SiLU-and-mul output quantized with one
        dynamic scale per row; "group" (block weights): one per 1 x bk group of a row; None
        (weight only): the activations stay 16-bit and the e4m3 weights are widened to their
        dtype in registers (exact: every e4m3 value is a bf16 / fp16 value).

The product of each K step is an fp32 MMA of e4m3 values (FP8 tensor cores on Hopper), its
partial sum moved to fp32 every BLOCK_K products (fp8_gemm.py: the MMA keeps ~14 bits), scaled
per column (channel: after the K loop; block: every K block, by a_scale * w_scale). Roundings
after the products are fused_moe's (transformers' expert loop): projections rounded to the
dtype, silu(gate) rounded before the product with up, the down output rounded before the
routing weight scales it, the K experts of a token summed in fp32 (moe_sum).

Tiles: fused_moe_tiles.tile_config at one byte a weight; block weights cap BLOCK_N at bn and
BLOCK_K at bk (a tile then lies in one scale block). gate_up always fuses SiLU-and-mul (gate and
up columns of a tile share their block rows' offsets).
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, quantize_fp8_groups
from .fp8_gemm import dequantize_blocks_ref, fake_quantize_groups_ref
from .fused_moe import (
    _SUM_BLOCK,
    _moe_sum_kernel,
    check_moe_args,
    store_rows,
    tile_of,
    warm_up_calls,
)
from .fused_moe_tiles import MoeTiles, tile_config
from .launch import check_launchable, tl, triton
from .moe_align import moe_align

ACT_NONE, ACT_TOKEN, ACT_GROUP = 0, 1, 2


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _expert_fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
    num_padded_ptr, N, K, num_pairs, num_m_blocks, up_offset, up_scale_offset,
    stride_am, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr, SILU: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    ACT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_W: tl.constexpr, W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # c[pair, n] = dequant(a[pair // A_ROWS_PER_TOKEN]) . dequant(w[expert(pair), n]) over K for
    # the BLOCK_M pairs of block pid_m (one expert) and BLOCK_N columns; with SILU the up
    # column up_offset + n too (its scale row: channel up_offset + n, block up_scale_offset +
    # n // W_BLOCK_N), and silu(gate) * up written. Program order as _expert_gemm_kernel's.
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
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # [BK, BN]
    ws_expert = ws_ptr + expert * stride_wse
    if BLOCK_W:  # the tile's block row of scales (BLOCK_N divides W_BLOCK_N)
        ws_gate = ws_expert + ((pid_n * BLOCK_N) // W_BLOCK_N) * stride_wsn
        ws_up = ws_expert + (up_scale_offset + (pid_n * BLOCK_N) // W_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if ACT == 0:
            w = w.to(a.dtype)  # exact: e4m3 values are 16-bit float values
        if BLOCK_W:
            kb = k0 // W_BLOCK_K  # BLOCK_K divides W_BLOCK_K: the step lies in one block
            scale = tl.load(ws_gate + kb)
            if ACT == 2:
                a_s = tl.load(as_ptr + a_rows * stride_as + kb, mask=valid, other=0.0)
                acc += tl.dot(a, w, input_precision=PRECISION) * (a_s[:, None] * scale)
            else:
                acc += tl.dot(a, w, input_precision=PRECISION) * scale
        elif ACT != 0:  # e4m3 x e4m3: the partial sum to fp32 every BLOCK_K products
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SILU:
            w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
                           other=0.0)  # fmt: skip
            if ACT == 0:
                w_up = w_up.to(a.dtype)
            if BLOCK_W:
                scale_up = tl.load(ws_up + kb)
                if ACT == 2:
                    acc_up += tl.dot(a, w_up, input_precision=PRECISION) * (a_s[:, None] * scale_up)
                else:
                    acc_up += tl.dot(a, w_up, input_precision=PRECISION) * scale_up
            elif ACT != 0:
                acc_up = tl.dot(a, w_up, acc_up, max_num_imprecise_acc=BLOCK_K)
            else:
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not BLOCK_W:  # channel scales (and the row's token scale) once, after the K loop
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
        if ACT == 1:
            row_scale = tl.load(as_ptr + a_rows * stride_as, mask=valid, other=0.0)
        w_s = tl.load(ws_expert + cols, mask=col_ok, other=0.0)
        acc = acc * row_scale[:, None] * w_s[None, :]
        if SILU:
            w_s_up = tl.load(ws_expert + up_offset + cols, mask=col_ok, other=0.0)
            acc_up = acc_up * row_scale[:, None] * w_s_up[None, :]
    store_rows(acc, acc_up, c_ptr, weights_ptr, pair, valid, cols, col_ok, stride_cm, SILU,
               MUL_WEIGHTS)  # fmt: skip


def expert_scale_shapes(E: int, H: int, inter: int, block: tuple[int, int] | None):
    """(w13_scale shape, w2_scale shape) of a scheme (module docstring)."""
    if block is None:
        return (E, 2 * inter), (E, H)
    bn, bk = block
    return (E, 2 * -(-inter // bn), -(-H // bk)), (E, -(-H // bn), -(-inter // bk))


def check_fp8_moe_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, scheme):
    """Shapes and dtypes of a fused FP8 MoE call (see fused_moe_fp8)."""
    op = "fused_moe_fp8"
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, FP8_DTYPE)
    if scheme.activation not in (None, "token", "group"):
        raise ValueError(f"{op}: activation {scheme.activation!r} is not supported for experts "
                         "(dynamic per token or per group, or weight only)")  # fmt: skip
    E, two_i, H = w13.shape
    want13, want2 = expert_scale_shapes(E, H, two_i // 2, scheme.block)
    for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"{op}: {name} must be {list(want)} float32 contiguous, got "
                             f"{tuple(s.shape)} {s.dtype}")  # fmt: skip


def _quantize_rows(x: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [M, K] as the GEMM reads it: (e4m3 rows, scales [M, 1] or [M, K / bk]) or (x, None)."""
    if scheme.activation is None:
        return x, None
    return quantize_fp8_groups(x, scheme.input_group)


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scheme,
    tiles: MoeTiles | None = None,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe with FP8 expert weights and `scheme`'s activations (module docstring); Triton.

    Args:
        hidden: [T, H] (bf16/fp16/fp32), rows contiguous.
        w13, w2: [E, 2I, H] and [E, H, I] float8_e4m3fn, contiguous.
        w13_scale, w2_scale: their float32 scales (module docstring: shapes per scheme).
        topk_weights, topk_ids, tiles, touched, token_slots: as fused_moe's.
        scheme: an Fp8Scheme with activation "token", "group" or None.

    Returns:
        [T, H] in hidden's dtype.
    """
    op = "fused_moe_fp8"
    check_fp8_moe_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, scheme)
    if hidden.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"{op}: hidden rows and the expert weights must be contiguous")
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    check_launchable(op, hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    out = torch.empty_like(hidden)
    if T == 0:
        return out
    if tiles is None:
        tiles = tile_config(T, E, H, inter, top_k, "float8_e4m3fn", 1)
    tiles = tiles._replace(fuse_activation=True)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, tiles.block_m, touched, token_slots)
    pairs = T * top_k
    layout = (sorted_ids, expert_ids, num_padded, pairs)
    a, a_s = _quantize_rows(hidden, scheme)
    act = hidden.new_empty(pairs, inter)
    nbi = -(-inter // scheme.block[0]) if scheme.block else 0
    _gemm(a, a_s, w13, w13_scale, act, None, layout, inter, top_k, nbi, scheme, tiles,
          tiles.gate_up)  # fmt: skip
    a, a_s = _quantize_rows(act, scheme)
    down = hidden.new_empty(pairs, H)
    _gemm(a, a_s, w2, w2_scale, down, topk_weights, layout, H, 1, 0, scheme, tiles, tiles.down)
    grid = (T, triton.cdiv(H, _SUM_BLOCK))
    _moe_sum_kernel[grid](down, out, H, down.stride(0), out.stride(0), TOP_K=top_k,
                          BLOCK=_SUM_BLOCK)  # fmt: skip
    return out


def _gemm(a, a_s, w, ws, c, weights, layout, n_out, rows_per_token, up_scale_offset, scheme,
          tiles, tile):  # fmt: skip
    """One grouped GEMM launch (see the kernel): gate_up (weights None: SiLU-and-mul, the up
    rows at n_out, their block scale rows at up_scale_offset) or down (weighted rows)."""
    sorted_ids, expert_ids, num_padded, num_pairs = layout
    silu = weights is None
    block_n, block_k = tile.block_n, tile.block_k
    if scheme.block is not None:
        block_n, block_k = min(block_n, scheme.block[0]), min(block_k, scheme.block[1])
    act = {None: ACT_NONE, "token": ACT_TOKEN, "group": ACT_GROUP}[scheme.activation]
    num_m_blocks = expert_ids.shape[0]
    grid = (num_m_blocks * triton.cdiv(n_out, block_n),)
    _expert_fp8_gemm_kernel[grid](
        a, a_s if a_s is not None else ws, w, ws, c, weights if weights is not None else ws,
        sorted_ids, expert_ids, num_padded, n_out, w.shape[2], num_pairs, num_m_blocks,
        n_out if silu else 0, up_scale_offset,
        a.stride(0), a_s.stride(0) if a_s is not None else 0, w.stride(0), w.stride(1),
        ws.stride(0), ws.stride(1) if ws.dim() == 3 else 0, c.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, SILU=silu, MUL_WEIGHTS=not silu, ACT=act,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_W=scheme.block is not None,
        W_BLOCK_N=scheme.block[0] if scheme.block else 1,
        W_BLOCK_K=scheme.block[1] if scheme.block else 1,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip


def warm_up(dtype, w13, w13_scale, w2, w2_scale, top_k, weights_dtype, scheme) -> int:
    """Compile every tile configuration fused_moe_fp8 picks for these weights and activations of
    `dtype`, whatever the token count (fused_moe.warm_up_calls); returns how many ran."""

    def call(hidden, weights, ids, tiles, touched, token_slots):
        fused_moe_fp8(hidden, w13, w13_scale, w2, w2_scale, weights, ids, scheme, tiles, touched,
                      token_slots)  # fmt: skip

    return warm_up_calls(w13, top_k, dtype, weights_dtype, "float8_e4m3fn", 1, call)


def dequantize_experts_ref(w: torch.Tensor, scale: torch.Tensor, scheme, split: int | None = None):
    """Expert weights [E, N, K] as the scheme defines them, float32: float(q) * scale. split:
    with block scales, rows [0, split) and [split, N) have their own block grids (gate, up)."""
    if scheme.block is None:
        return w.float() * scale[:, :, None]
    bn = scheme.block[0]
    parts = [(0, split), (split, w.shape[1])] if split else [(0, w.shape[1])]
    out, first = [], 0
    for lo, hi in parts:
        rows = -(-(hi - lo) // bn)
        blocks = scale[:, first : first + rows]
        out.append(torch.stack([dequantize_blocks_ref(w[e, lo:hi], blocks[e], scheme.block)
                                for e in range(w.shape[0])]))  # fmt: skip
        first += rows
    return torch.cat(out, dim=1)


def _input_ref(x: torch.Tensor, scheme) -> torch.Tensor:
    """x [M, K] as the scheme feeds it to a projection, dequantized back to float32."""
    if scheme.activation is None:
        return x.float()
    return fake_quantize_groups_ref(x, scheme.input_group)


def fused_moe_fp8_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scheme,
) -> torch.Tensor:
    """Torch reference of fused_moe_fp8: fused_moe_ref's expert loop with each projection the
    scheme's exact math in fp32 (input quantized and dequantized, weight dequantized), its
    output rounded to the dtype."""
    check_fp8_moe_args(hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, scheme)
    T, H = hidden.shape
    inter, top_k = w13.shape[1] // 2, topk_ids.shape[1]
    dt = hidden.dtype
    w13f = dequantize_experts_ref(w13, w13_scale, scheme, inter)  # [E, 2I, H]
    w2f = dequantize_experts_ref(w2, w2_scale, scheme)  # [E, H, I]
    rows = hidden.new_zeros(T, top_k, H)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        gate_up = (_input_ref(hidden[token], scheme) @ w13f[e].t()).to(dt)
        gate, up = gate_up.split(inter, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        y = (_input_ref(act, scheme) @ w2f[e].t()).to(dt)  # [n, H]
        rows[token, slot] = (y.float() * topk_weights[token, slot, None].float()).to(dt)
    out = rows[:, 0].to(torch.float32, copy=True)
    for k in range(1, top_k):
        out += rows[:, k].float()
    return out.to(dt)
