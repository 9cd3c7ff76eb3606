"""FP8 (e4m3, the `float8_e4m3fn` format: max 448, no infinities) quantization: the rounding every
kernel that writes FP8 shares, a static-scale quantize kernel, and the torch references.

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
# 1.5 * 2^23: adding and subtracting it rounds an fp32 |y| < 2^22 to an integer, ties to even.
_ROUND_MAGIC = 12582912.0


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
    r = ((x * inv_step + _ROUND_MAGIC) - _ROUND_MAGIC) * step
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
