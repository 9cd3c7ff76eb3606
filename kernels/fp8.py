"""FP8 (e4m3, the `float8_e4m3fn` format: max 448, no infinities) quantization: the rounding every
kernel that writes FP8 shares, static-scale and dynamic per-row / per-group quantize kernels
(activations of FP8 GEMMs), and the torch references.

quantize(x, scale) = round_e4m3(clamp(x / scale, -448, 448)), the division in fp32 (IEEE),
the rounding to nearest, ties to even; dequantize(q, scale) = float(q) * scale. Kernels divide
with div_rn and then build the e4m3 code from the quotient's fp32 bits with integer arithmetic
only (`e4m3_code`), stored through a bitcast: no floating-point rounding step is left that a
compiler could contract, reassociate or flush to zero, and no fp32 -> fp8 conversion (Triton's
interpreter converts wrongly where rounding carries into the next exponent: 125.4 became 64),
so the compiled kernel, the interpreter and torch's cast give the same byte.
"""

from __future__ import annotations

import torch

from .launch import check_launchable, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Dynamic scales are max(amax, MIN_AMAX) / 448: an all-zero row gets a tiny scale, not 0 / 0.
MIN_AMAX = 1e-12


@triton.jit
def e4m3_code(y):
    # fp32 y -> its e4m3 byte (int32 in [0, 255]): round to nearest, ties to even, |y| >= 448
    # saturated to 448 (code 126), NaN kept (127), the sign bit copied (-0.0 -> 0x80). Integer
    # arithmetic on y's bits: with a = |y|'s bits, exponent E = a >> 23, mantissa m.
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # e4m3 normals (|y| >= 2^-6, E >= 121): keep 3 of the 23 mantissa bits, the 20 dropped ones
    # rounded to nearest even by adding 0x7FFFF plus the kept lowest bit (a carry moves into the
    # exponent, as it should); rebias the exponent 127 -> 7: minus 120 << 3. `a` is capped at
    # 480's bits first (anything larger saturates anyway), so the sum cannot overflow.
    ac = tl.minimum(a, 0x43F00000)
    normal = ((ac + 0x7FFFF + ((ac >> 20) & 1)) >> 20) - 960
    # e4m3 subnormals (|y| < 2^-6): code = |y| / 2^-9 rounded to nearest even, and
    # |y| = (m | 2^23) * 2^(E - 150), so the code is (m | 2^23) >> (141 - E), rounded. A shift of
    # 30 or more (E <= 111, or fp32 subnormals) leaves 0.
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 1), 30)  # only E <= 120 uses it
    m = (a & 0x7FFFFF) | 0x800000
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0x3C800000, tl.minimum(normal, 126), sub)
    code = tl.where(a > 0x7F800000, 127, code)
    return code | sign


@triton.jit
def quantize_e4m3(x, scale):
    # x (any float dtype) / scale (fp32), as the e4m3 value to store (float8e4nv).
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return e4m3_code(y).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


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
    scales = amax / torch.full_like(amax, FP8_MAX)  # an IEEE quotient on CUDA too
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
    return (x.float() / _divisor(scale, x.device)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _divisor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    # A tensor on x's device: torch's CUDA division by a Python number (or a CPU scalar tensor)
    # multiplies by its rounded reciprocal, one ulp off the IEEE quotient the kernels compute.
    return torch.as_tensor(scale, dtype=torch.float32, device=device)


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
