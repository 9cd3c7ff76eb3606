"""Decode-step projections with the op before them folded in: out[M, N] = f(x)[M, K] @ w[N, K]^T
for few rows (M <= MAX_ROWS), where f is RMSNorm, residual add + RMSNorm, or SiLU-and-mul.

At decode shapes a projection is a read of its weight, and the small kernel in front of it (the
norm, the activation) costs a launch of its own for a few kilobytes of work. Here each program
applies f to the activation tiles as it loads them: a [BLOCK_M, BLOCK_N] output tile, the whole
K range (no split, so there is no second kernel). f rounds like the kernels it replaces
(rms_norm.py, activation.py), so the product's operand is the same as theirs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .activation import silu_and_mul_ref
from .launch import check_dtype, check_launchable, tl, triton
from .rms_norm import fused_add_rms_norm_ref, rms_norm_ref

# Rows above this go to the separate kernels and cuBLAS (prefill: compute-bound, large).
MAX_ROWS = 256
GEMM_DTYPES = (torch.float16, torch.bfloat16)

# What is applied to x before the product.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3


class GemmConfig(NamedTuple):
    """Tile sizes and launch shape of one skinny GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr,
    M, N, K, stride_x, stride_res, stride_w, stride_out, stride_res_out, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): output tile [BLOCK_M, BLOCK_N] over all of K.
    # x is [M, K] ([M, 2K] for SILU_MUL: gate columns, then up); w [N, K]. PROLOGUE is
    # PLAIN 0, NORM 1, ADD_NORM 2 or SILU_MUL 3 (literals: kernels read no Python globals).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    res_rows = res_ptr + rows[:, None].to(tl.int64) * stride_res
    dtype = w_ptr.dtype.element_ty
    if PROLOGUE == 1 or PROLOGUE == 2:
        # The row statistics first (fp32), over the rounded sum when adding the residual.
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                r = tl.load(res_rows + (k0 + ks)[None, :], mask=row_ok, other=0.0)
                h = (h + r.to(tl.float32)).to(dtype).to(tl.float32)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sum_sq / K + eps)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    col_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        if PROLOGUE == 2:
            r = tl.load(res_rows + (k0 + ks)[None, :], mask=row_ok, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if pid_n == 0:  # one column of programs writes the new residual stream
                res_out = res_out_ptr + rows[:, None].to(tl.int64) * stride_res_out
                tl.store(res_out + (k0 + ks)[None, :], a, mask=row_ok)
        if PROLOGUE == 1 or PROLOGUE == 2:
            # As rms_norm: normalise and round, then one rounding of weight * normed.
            g = tl.load(g_ptr + k0 + ks).to(tl.float32)
            normed = (a.to(tl.float32) * rstd[:, None]).to(dtype)
            a = (g[None, :] * normed.to(tl.float32)).to(dtype)
        if PROLOGUE == 3:
            # As silu_and_mul: silu(gate) rounded, times up, rounded.
            up = tl.load(x_rows + (K + k0 + ks)[None, :], mask=row_ok, other=0.0)
            gate = a.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
        w = tl.load(w_tile, mask=col_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(w), acc)
        w_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(dtype), mask=row_ok & (cols[None, :] < N))


def choose_config(m: int, n: int, k: int) -> GemmConfig:
    """Tiles for m rows of a [n, k] weight: rows in one or a few tiles, N narrow enough that
    the weight read spreads over about one program per SM."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 16 if n <= 2048 else 32 if n <= 8192 else 64
    block_k = 256 if k % 256 == 0 else 128 if k % 128 == 0 else 64
    return GemmConfig(block_m, block_n, block_k)


def supports(x: torch.Tensor, w: torch.Tensor, prologue: int) -> bool:
    """Whether the fused kernel takes this product (else the caller runs the ops separately):
    a CUDA bf16/fp16 decode-sized x and a weight whose K the tiles divide."""
    k = w.shape[1]
    rows = x.shape[0]
    return (
        x.is_cuda
        and x.dtype in GEMM_DTYPES
        and 0 < rows <= MAX_ROWS
        and k % 64 == 0
        and x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    )


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    prologue: int = PLAIN,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """f(x) @ w.T (+ bias) for a few rows, Triton kernel.

    Args:
        x: [M, K] bf16/fp16, rows contiguous; [M, 2K] (gate, then up) for SILU_MUL.
        w: [N, K] in x's dtype, rows contiguous (an nn.Linear weight); bias: [N] or None.
        prologue: PLAIN, NORM (rms_norm(x) with norm_weight [K], eps), ADD_NORM (the same of
            x + residual), or SILU_MUL (silu(x[:, :K]) * x[:, K:]).
        residual: [M, K] for ADD_NORM.
        config: tiles; None picks them with choose_config.

    Returns:
        (out [M, N] in x.dtype with fp32 accumulation, the new residual x + residual [M, K]
        for ADD_NORM else None).
    """
    op = "skinny_gemm"
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{op}: expected x [M, K] and w [N, K], got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    m, (n, k) = x.shape[0], w.shape
    if x.shape[1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"{op}: x {tuple(x.shape)} does not fit w {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{op}: x and w rows must be contiguous")
    check_dtype(op, "x", x, GEMM_DTYPES)
    if w.dtype != x.dtype:
        raise ValueError(f"{op}: w has dtype {w.dtype}, x has {x.dtype}")
    if k % 64:
        raise ValueError(f"{op}: K={k} must be a multiple of 64")
    if prologue in (NORM, ADD_NORM) and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"{op}: the norm needs norm_weight [{k}]")
    if prologue == ADD_NORM and (residual is None or residual.shape != (m, k)):
        raise ValueError(f"{op}: ADD_NORM needs a residual [{m}, {k}]")
    if residual is not None and residual.stride(1) != 1:
        raise ValueError(f"{op}: residual rows must be contiguous")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{op}: bias must be [{n}], got {tuple(bias.shape)}")
    check_launchable(op, *[t for t in (x, w, bias, norm_weight, residual) if t is not None])
    cfg = config or choose_config(m, n, k)
    if k % cfg.block_k:
        raise ValueError(f"{op}: block_k {cfg.block_k} does not divide K={k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if prologue == ADD_NORM else None
    if m == 0:
        return out, res_out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _skinny_gemm_kernel[grid](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else w, w, bias if bias is not None else w,
        out, res_out if res_out is not None else out,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, w.stride(0),
        out.stride(0), res_out.stride(0) if res_out is not None else 0, eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, res_out


def skinny_gemm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    prologue: int = PLAIN,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of skinny_gemm: the separate references, then F.linear (config is
    ignored)."""
    new_residual = None
    if prologue == NORM:
        x = rms_norm_ref(x, norm_weight, eps)
    elif prologue == ADD_NORM:
        x, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    elif prologue == SILU_MUL:
        x = silu_and_mul_ref(x)
    return torch.nn.functional.linear(x, w, bias), new_residual
