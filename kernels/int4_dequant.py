"""Dequantize a packed 4-bit weight (kernels/int4_gemm.py's layout) to a 16-bit [K, N] matrix in
input-channel order: Triton kernel, launcher, torch reference.

Large prefill steps multiply many rows by each weight: there a dense GEMM on the dequantized
weight (cuBLAS, tensor cores at full rate) can beat dequantizing in every tile of a fused
kernel. Row k of the output is input channel k: an act-order layout's rows are written to
perm[k], so the product needs no gather of x. Output [K, N] row-major is W^T, which
`torch.mm(x, out)` (or F.linear with out.t(), a K-major [N, K] weight) multiplies as is.
"""

from __future__ import annotations

import torch

from .int4_gemm import check_layout, dequantize_int4_ref
from .launch import check_dtype, check_launchable, tl, triton

_BLOCK_K = 32
_BLOCK_N = 256


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, N, stride_qk, stride_sg, stride_ok,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):  # fmt: skip
    # Program (pk, pn): layout rows [pk*BK, +BK), columns [pn*BN, +BN); BK divides GROUP.
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows_p = tl.arange(0, BLOCK_K // 8)
    packed = tl.load(
        qw_ptr + (k0 // 8 + rows_p)[:, None] * stride_qk + offs_n[None, :],
        mask=mask_n[None, :], other=0,
    )  # fmt: skip
    shifts = tl.arange(0, 8) * 4
    q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    g = k0 // GROUP
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z[None, :]) * s[None, :]  # [BK, BN]
    else:
        w = (q - 8).to(tl.float32) * s[None, :]
    rows = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        rows = tl.load(perm_ptr + rows)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_ok + offs_n[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_n[None, :])


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The packed weight as a [K, N] matrix of `dtype` in input-channel order, Triton kernel.

    Args:
        qweight, scales, zeros, group_size, perm: the packed layout (contiguous tensors; zeros
            None: symmetric, zero point 8).
        dtype: bf16 / fp16 / fp32; each element is (q - zero) * scale in fp32, rounded once.
        out: optional [K, N] of `dtype` with contiguous rows to write into.
    """
    op = "dequantize_int4"
    k, n = check_layout(op, qweight, scales, zeros, group_size, perm)
    if group_size % _BLOCK_K:
        raise ValueError(f"{op}: group_size {group_size} must be a multiple of {_BLOCK_K}")
    if out is None:
        out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    elif out.shape != (k, n) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"{op}: out must be [{k}, {n}] {dtype} with contiguous rows")
    check_dtype(op, "out", out)
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    check_launchable(op, qweight, scales, out, *[t for t in (zeros, perm) if t is not None])
    grid = (k // _BLOCK_K, triton.cdiv(n, _BLOCK_N))
    _int4_dequant_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales,
        perm if perm is not None else qweight, out, n,
        qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_K=_BLOCK_K, BLOCK_N=_BLOCK_N, HAS_PERM=perm is not None,
        HAS_ZEROS=zeros is not None, num_warps=8,
    )  # fmt: skip
    return out


def dequantize_int4_ordered_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of dequantize_int4: fp32 (q - zero) * scale rounded to dtype, rows moved
    to their input channels."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size).to(dtype)  # layout order
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[perm] = w
    return out
