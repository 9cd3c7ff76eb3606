"""FP8 GEMMs in Triton: block-scaled (weights in 128 x 128 blocks, activations in 1 x 128 groups,
each with its fp32 scale, the layout of DeepSeek-V3 / Qwen3 `-FP8` checkpoints) and row-wise
(a scale per activation row and per weight row), with torch references. Row-wise products in
bf16 run through torch._scaled_mm (cuBLASLt) instead; this kernel serves the fp16 / fp32
activations cuBLASLt's row-wise FP8 does not take.

y[m, n] = sum over k-blocks b of (x_q[m, b] . w_q[n, b]) * x_scale[m, b] * w_scale[n // BN, b],
each block's dot an fp32 product of e4m3 values (FP8 tensor cores on Hopper), scaled and summed
in fp32.

Accuracy: Hopper's FP8 MMA does not add in full fp32: it keeps about 14 significant bits of
the running sum and drops the rest (DeepSeek-V3 technical report, section 3.3.2), and Triton
lets it run over the whole K loop unless told otherwise (max_num_imprecise_acc). Both kernels
here therefore move the partial sum into an fp32 register every 128 products (the block
kernel through its per-block scales, the row-wise one with max_num_imprecise_acc=128), as
cuBLASLt does without fast accumulation. `fp8_gemm_error_bound` states the resulting bound
against the fp32 references; on CPU (the interpreter) the sums are plain fp32.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, quantize_fp8_groups_ref
from .launch import check_launchable, interpreting, tl, triton

# Rows and columns of the output a program computes on a GPU; BLOCK_N divides the weight block.
GEMM_BLOCK_M = 64
GEMM_BLOCK_N = 128
GEMM_NUM_WARPS = 4
GEMM_NUM_STAGES = 3
# The MMA's partial sum keeps about 14 significant bits, losing up to 2^-13 of the magnitudes
# it holds each time new products are aligned to it; counting generously 8 such steps per
# 128-product chunk (2 per k-step of 32) bounds a chunk's error by 8 * 2^-13 of its sum of
# |x_k * w_k|, and the fp32 adds of the chunks add nothing comparable.
FP8_MMA_REL_ERROR = 8 * 2.0**-13


@triton.jit
def _block_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K,
    stride_x, stride_xs, stride_w, stride_ws, stride_y,
    WEIGHT_BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ROWWISE: tl.constexpr,
):  # fmt: skip
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)). Blocks: BLOCK_N divides WEIGHT_BLOCK_N, so one
    # weight scale row serves the tile; the K loop walks the GROUP_K-wide scale groups. ROWWISE:
    # one scale per x row (xs [M, 1]) and per w row (ws [N]), applied once after the K loop.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * stride_w  # [1, BLOCK_N]: w^T tiles
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // WEIGHT_BLOCK_N) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, tl.cdiv(K, GROUP_K)):
        k = b * GROUP_K + ks
        a = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_rows + k[:, None], mask=(k < K)[:, None] & col_mask[None, :], other=0.0)
        if ROWWISE:  # the 128 products' partial sum is added to acc in fp32
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=GROUP_K)
        else:
            a_scale = tl.load(xs_ptr + rows * stride_xs + b, mask=row_mask, other=0.0)
            w_scale = tl.load(ws_row + b)
            acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
    if ROWWISE:
        a_scale = tl.load(xs_ptr + rows * stride_xs, mask=row_mask, other=0.0)
        w_scale = tl.load(ws_ptr + cols, mask=col_mask, other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _check(op, x_q, x_scale, w_q, w_scale, block, bias):
    if not (x_q.dim() == 2 and w_q.dim() == 2 and x_q.shape[1] == w_q.shape[1]):
        raise ValueError(f"{op}: x_q [M, K] and w_q [N, K] needed, got {tuple(x_q.shape)}, "
                         f"{tuple(w_q.shape)}")  # fmt: skip
    if not (x_q.dtype == w_q.dtype == FP8_DTYPE):
        raise ValueError(f"{op}: x_q and w_q must be {FP8_DTYPE}, got {x_q.dtype}, {w_q.dtype}")
    (M, K), N = x_q.shape, w_q.shape[0]
    bn, bk = block
    kb, nb = -(-K // bk), -(-N // bn)
    if x_scale.shape != (M, kb) or x_scale.dtype != torch.float32:
        raise ValueError(f"{op}: x_scale must be [{M}, {kb}] float32, got "
                         f"{tuple(x_scale.shape)} {x_scale.dtype}")  # fmt: skip
    if w_scale.shape != (nb, kb) or w_scale.dtype != torch.float32:
        raise ValueError(f"{op}: w_scale must be [{nb}, {kb}] float32, got "
                         f"{tuple(w_scale.shape)} {w_scale.dtype}")  # fmt: skip
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"{op}: bias must be [{N}], got {tuple(bias.shape)}")


def fp8_block_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = dequant(x_q) @ dequant(w_q)^T (+ bias), Triton kernel.

    Args:
        x_q: [M, K] float8_e4m3fn, rows contiguous; x_scale: [M, ceil(K / block_k)] float32.
        w_q: [N, K] float8_e4m3fn, contiguous; w_scale: [ceil(N / block_n), ceil(K / block_k)]
            float32 (a checkpoint's weight_scale_inv: the multiplier that dequantizes).
        out_dtype: the output's dtype (bf16, fp16 or fp32).
        block: (block_n, block_k) of the weight scales; block_k is also the activation group.
        bias: [N] or None, added in fp32 before the output's rounding.

    Returns:
        [M, N] in out_dtype.
    """
    op = "fp8_block_gemm"
    _check(op, x_q, x_scale, w_q, w_scale, block, bias)
    if x_q.stride(1) != 1 or not (w_q.is_contiguous() and x_scale.is_contiguous()):
        raise ValueError(f"{op}: x_q rows, w_q and x_scale must be contiguous")
    if not w_scale.is_contiguous():
        raise ValueError(f"{op}: w_scale must be contiguous")
    check_launchable(op, x_q, x_scale, w_q, w_scale, *([bias] if bias is not None else []))
    (M, K), N = x_q.shape, w_q.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    bn, bk = block
    block_m, block_n, warps, stages = (16, 32, 4, 1) if interpreting() else (
        GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_NUM_WARPS, GEMM_NUM_STAGES)  # fmt: skip
    block_n = min(block_n, bn)
    if bn % block_n:
        raise ValueError(f"{op}: weight block_n {bn} must be a multiple of {block_n}")
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _block_gemm_kernel[grid](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else y, y, M, N, K,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), w_scale.stride(0), y.stride(0),
        WEIGHT_BLOCK_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, ROWWISE=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def fp8_rowwise_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (float(x_q) * x_scale) @ (float(w_q) * w_scale[:, None])^T (+ bias), Triton kernel.

    Args:
        x_q: [M, K] float8_e4m3fn, rows contiguous; x_scale: [M, 1] float32.
        w_q: [N, K] float8_e4m3fn, contiguous; w_scale: [N] float32.
        out_dtype: the output's dtype; bias: [N] or None.
    """
    op = "fp8_rowwise_gemm"
    (M, K), N = x_q.shape, w_q.shape[0]
    if w_scale.shape != (N,):
        raise ValueError(f"{op}: w_scale must be [{N}] float32, got {tuple(w_scale.shape)}")
    _check(op, x_q, x_scale, w_q, w_scale.view(N, 1), (1, max(K, 1)), bias)
    if x_q.stride(1) != 1 or not (w_q.is_contiguous() and x_scale.is_contiguous()):
        raise ValueError(f"{op}: x_q rows, w_q and x_scale must be contiguous")
    check_launchable(op, x_q, x_scale, w_q, w_scale, *([bias] if bias is not None else []))
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return y
    block_m, block_n, warps, stages = (16, 32, 4, 1) if interpreting() else (
        GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_NUM_WARPS, GEMM_NUM_STAGES)  # fmt: skip
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _block_gemm_kernel[grid](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else y, y, M, N, K,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), 0, y.stride(0),
        WEIGHT_BLOCK_N=block_n, GROUP_K=128, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_BIAS=bias is not None, ROWWISE=True, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def fp8_rowwise_gemm_ref(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of fp8_rowwise_gemm (and of torch._scaled_mm with row-wise scales)."""
    y = (x_q.float() * x_scale) @ (w_q.float() * w_scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def dequantize_blocks_ref(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float(q) [R, C] times scale[r // block[0], c // block[1]], in fp32."""
    R, C = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:R, :C]
    return q.float() * full


def fake_quantize_groups_ref(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x [M, K] quantized dynamically per row (group None) or per 1 x group columns, as
    quantize_fp8_groups_ref does, and dequantized back: float32."""
    q, s = quantize_fp8_groups_ref(x, group)
    return dequantize_blocks_ref(q, s, (1, group or x.shape[1]))


def fp8_block_gemm_ref(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of fp8_block_gemm: both operands dequantized to fp32, one fp32 matmul."""
    _check("fp8_block_gemm", x_q, x_scale, w_q, w_scale, block, bias)
    x = dequantize_blocks_ref(x_q, x_scale, (1, block[1]))
    y = x @ dequantize_blocks_ref(w_q, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_gemm_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far an FP8 tensor-core GEMM may lie from the fp32 product of the same operands.

    Args:
        x: [M, K] and w: [N, K], the dequantized operands (fp32) the references multiply.

    Returns:
        [M, N] fp32: FP8_MMA_REL_ERROR * (|x| @ |w|^T), the accumulation's share of the error
        (the output dtype's rounding comes on top).
    """
    return FP8_MMA_REL_ERROR * (x.float().abs() @ w.float().abs().t())
