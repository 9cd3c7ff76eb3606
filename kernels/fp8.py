"""FP8 (e4m3, the `float8_e4m3fn` format: max 448, no infinities) quantization: the rounding every
kernel that writes FP8 shares, static-scale and dynamic per-row / per-group quantize kernels
(activations of FP8 GEMMs), and the torch references.

quantize(x, scale) = round_to_e4m3(clamp(x / scale, -448, 448)), the division in fp32 (IEEE),
the rounding to nearest, ties to even; dequantize(q, scale) = float(q) * scale. Kernels round
in fp32 arithmetic (`round_to_e4m3`) and then cast a value that is already on the e4m3 grid:
Triton's interpreter converts fp32 -> fp8 wrongly where rounding carries into the next
exponent (125.4 becomes 64 instead of 128), while the cast of a grid value is exact everywhere.
"""

from __future__ import annotations

import torch

from .launch import check_launchable, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Dynamic scales are max(amax, MIN_AMAX) / 448: an all-zero row gets a tiny scale, not 0 / 0.
MIN_AMAX = 1e-12


@triton.jit
def round_to_e4m3(x):
    # fp32 x -> the nearest e4m3 value as fp32 (ties to even, saturated at +-448, sign of zero
    # kept). e4m3 has 3 mantissa bits: within binade 2^e its step is 2^(e-3); below 2^-6
    # (subnormals) the step stays 2^-9. Powers of two are built from their exponent bits, so
    # every multiply here is exact and only the magic-number add rounds.
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    # 12582912 = 1.5 * 2^23: adding and subtracting it rounds an fp32 |y| < 2^22 to an integer,
    # ties to even (a literal: compiled kernels read no non-constexpr globals).
    r = ((x * inv_step + 12582912.0) - 12582912.0) * step
    r = tl.minimum(tl.maximum(r, -448.0), 448.0)
    return tl.where(bits < 0, -tl.abs(r), tl.abs(r))  # the sign bit, -0.0 included


@triton.jit
def quantize_e4m3(x, scale):
    # x (any float dtype) / scale (fp32), rounded to e4m3 and cast: the value to store.
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, quantize_e4m3(x, tl.load(scale_ptr)), mask=mask)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, out_ptr, scale_ptr, K, GROUP, NUM_GROUPS, stride_x, stride_o,
    BLOCK: tl.constexpr, MIN_AMAX_C: tl.constexpr,
):  # fmt: skip
    # Program (row m, group g): columns [g * GROUP, min((g + 1) * GROUP, K)) of row m share one
    # scale max(amax, MIN_AMAX) / 448 (written to scale[m, g]); two passes over BLOCK-wide
    # chunks, the max then the quantized values. A whole row is one group (per-token scales).
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * GROUP
    hi = tl.minimum(lo + GROUP, K)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_x + cols, mask=cols < hi, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), MIN_AMAX_C), 448.0)
    tl.store(scale_ptr + m * NUM_GROUPS + g, scale)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_x + cols, mask=cols < hi, other=0.0)
        tl.store(out_ptr + m * stride_o + cols, quantize_e4m3(x, scale), mask=cols < hi)


def quantize_fp8_groups(
    x: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of x [M, K] (rows contiguous, any float dtype) with one scale per row
    (group None: per token) or per 1 x `group` columns of a row, Triton kernel.

    Returns:
        (q [M, K] float8_e4m3fn, scales [M, G] float32 with G = 1 or ceil(K / group)), where
        scale = max(max |x| over the group, MIN_AMAX) / 448 and q = quantize(x, scale).
    """
    op = "quantize_fp8_groups"
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{op}: x must be [M, K] with contiguous rows, got {tuple(x.shape)}")
    if group is not None and group < 1:
        raise ValueError(f"{op}: group must be >= 1, got {group}")
    check_launchable(op, x)
    M, K = x.shape
    group = K if group is None else group
    num_groups = max(1, -(-K // group))
    out = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((M, num_groups), dtype=torch.float32, device=x.device)
    if M and K:
        block = min(1024, 1 << max(group - 1, 0).bit_length())
        _quantize_groups_kernel[(M, num_groups)](
            x, out, scales, K, group, num_groups, x.stride(0), out.stride(0),
            BLOCK=block, MIN_AMAX_C=MIN_AMAX, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return out, scales


def quantize_fp8_groups_ref(
    x: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_fp8_groups."""
    M, K = x.shape
    group = K if group is None else group
    num_groups = max(1, -(-K // group))
    xf = torch.nn.functional.pad(x.float(), (0, num_groups * group - K))
    xf = xf.view(M, num_groups, group)
    amax = xf.abs().amax(dim=-1).clamp(min=MIN_AMAX)  # [M, G]
    scales = amax / FP8_MAX
    q = quantize_fp8_ref(xf, scales[..., None]).view(M, num_groups * group)[:, :K]
    return q.contiguous(), scales


def check_scale(op: str, name: str, scale: torch.Tensor, numel: int = 1) -> None:
    """A scale tensor: `numel` float32 values, contiguous."""
    if not (scale.dtype == torch.float32 and scale.numel() == numel and scale.is_contiguous()):
        raise ValueError(
            f"{op}: {name} must be {numel} contiguous float32 value(s), got "
            f"{tuple(scale.shape)} {scale.dtype}"
        )


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (contiguous, any float dtype) quantized with one fp32 scale [1], Triton kernel; returns
    a float8_e4m3fn tensor of x's shape."""
    check_scale("quantize_fp8", "scale", scale)
    if not x.is_contiguous():
        raise ValueError("quantize_fp8: x must be contiguous")
    check_launchable("quantize_fp8", x, scale)
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    if n:
        block = 1024
        _quantize_kernel[(triton.cdiv(n, block),)](x, out, scale, n, BLOCK=block)
    return out


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Torch reference: clamp(x / scale) in fp32, then torch's round-to-nearest-even cast."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """float(q) * scale in fp32."""
    return q.float() * scale


def check_kv_cache_dtype(
    op: str,
    dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
) -> bool:
    """The caches hold the activations' `dtype` (kv_scale None), or FP8 e4m3 with kv_scale
    [2] float32 (k_scale, v_scale) on their device. Returns whether they are FP8."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"{op}: k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.dtype == FP8_DTYPE:
        if kv_scale is None:
            raise ValueError(f"{op}: FP8 caches need kv_scale, [2] float32 (k_scale, v_scale)")
        check_scale(op, "kv_scale", kv_scale, 2)
        if kv_scale.device != k_cache.device:
            raise ValueError(
                f"{op}: kv_scale is on {kv_scale.device}, the caches on {k_cache.device}"
            )
        return True
    if k_cache.dtype != dtype:
        raise ValueError(
            f"{op}: caches hold {k_cache.dtype}; expected {dtype} (the activations') or {FP8_DTYPE}"
        )
    if kv_scale is not None:
        raise ValueError(f"{op}: kv_scale is for FP8 caches; these hold {k_cache.dtype}")
    return False
