"""SiLU-and-multiply of a fused gate/up projection: Triton kernel and reference."""

from __future__ import annotations

import torch

from .launch import check_dtype, check_launchable, tl, triton

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, BLOCK: tl.constexpr):
    # Grid (T, cdiv(I, BLOCK)): row t, columns [j*BLOCK, (j+1)*BLOCK) of gate and up.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t * stride_x
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Rounded to the input dtype before the product, as HF's act_fn(gate) * up.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection, Triton kernel.

    Args:
        x: [T, 2I] (bf16/fp16/fp32), columns [:I] the gate, [I:] the up projection; rows
            contiguous.

    Returns:
        [T, I] in x.dtype.
    """
    op = "silu_and_mul"
    if not (x.dim() == 2 and x.shape[1] % 2 == 0):
        raise ValueError(f"{op}: x must be [T, 2I], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{op}: x rows must be contiguous, got strides {x.stride()}")
    check_dtype(op, "x", x)
    check_launchable(op, x)
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    grid = (T, triton.cdiv(I, _BLOCK))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), I, BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of silu_and_mul, in the input dtype like HF's LlamaMLP."""
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]
