"""Skinny GEMM for decode steps: out[M, N] = x[M, K] @ w[N, K]^T with few rows (M <= 256).

At decode-step shapes a projection is a read of its weight matrix. Tiles that are narrow in N,
and a K range split over several programs when N alone gives too few of them, put every SM to
work on the read; the split's fp32 partial sums are added by a second small kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .launch import check_dtype, check_launchable, num_sms, tl, triton

# Rows above this go to torch (cuBLAS): the problem is then compute-bound and large enough.
MAX_ROWS = 256
_GEMM_DTYPES = (torch.float16, torch.bfloat16)


class GemmConfig(NamedTuple):
    """Tile sizes, K split and launch shape of one skinny GEMM."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    stride_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): an output tile over one K range.
    # SPLIT_K > 1 writes fp32 partials at out + split * stride_split.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT_K  # the launcher checks K % (SPLIT_K * BLOCK_K) == 0
    k0 = pid_k * k_len
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_x + (k0 + ks)[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_w + (k0 + ks)[None, :]
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        x = tl.load(x_tile, mask=row_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_tile, mask=col_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = out_ptr + pid_k * stride_split + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    # Grid (cdiv(numel, BLOCK),): out = sum over the SPLIT_K fp32 partials [SPLIT_K, numel].
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig | None:
    """Tiles for an [m, k] x [n, k]^T product, or None when the shape does not suit the kernel.

    BLOCK_M covers the rows in one or two tiles; BLOCK_N is narrow so the weight read spreads
    over many programs; the K split is the smallest that gives about one program per SM.
    """
    if m > MAX_ROWS or n % 16 or k % 64:
        return None
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m > 64 else 32
    block_k = 128 if k % 128 == 0 else 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while tiles * split < num_sms(device) and k % (2 * split * block_k) == 0 and split < 8:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split, num_warps=4, num_stages=4)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """x @ w.T for a few rows, Triton kernel.

    Args:
        x: [M, K] bf16/fp16, rows contiguous.
        w: [N, K], x's dtype, rows contiguous (an nn.Linear weight).
        config: tiles and K split; None picks them with choose_config.

    Returns:
        [M, N] in x.dtype (fp32 accumulation).
    """
    op = "skinny_gemm"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: expected x [M, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{op}: x and w rows must be contiguous")
    check_dtype(op, "x", x, _GEMM_DTYPES)
    if w.dtype != x.dtype:
        raise ValueError(f"{op}: w has dtype {w.dtype}, x has {x.dtype}")
    check_launchable(op, x, w)
    (m, k), n = x.shape, w.shape[0]
    cfg = config or choose_config(m, n, k, x.device)
    if cfg is None or k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"{op}: no tiling for M={m}, N={n}, K={k} with {cfg}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    target = out
    if cfg.split_k > 1:
        target = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    _skinny_gemm_kernel[grid](
        x, w, target, m, n, k, x.stride(0), w.stride(0), n, m * n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.split_k > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=cfg.split_k, BLOCK=block, num_warps=4
        )
    return out


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference: fp32 product rounded to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)
