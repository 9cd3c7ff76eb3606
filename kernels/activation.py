"""SiLU-and-multiply of a fused gate/up projection: Triton kernel and reference."""

from __future__ import annotations

import torch

from .launch import check_dtype, check_launchable, pdl_prologue, pow2, tl, triton, use_pdl
from .rms_norm import check_rms_rows, rms_scale_rows_ref, row_rms_scale

_BLOCK = 1024
# With rms_rows each program also reads its hidden row for the scale: wider column blocks
# read it fewer times per row.
_BLOCK_RMS = 4096


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, rms_ptr, stride_x, stride_out, stride_rms, I, num_col_blocks, rms_eps,
    BLOCK: tl.constexpr, ROW_RMS: tl.constexpr, HID: tl.constexpr, BLOCK_HID: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program p: row t = p // num_col_blocks, columns [j*BLOCK, (j+1)*BLOCK) of gate and up,
    # j = p % num_col_blocks (the blocks of one row run side by side, so with ROW_RMS the
    # hidden row they all read stays in L2). ROW_RMS: gate_up came from the un-normalised
    # hidden rows rms_ptr [T, HID] (the RMSNorm weight folded into the projection), so gate and
    # up are first scaled by 1 / RMS of row t and rounded, as the normalised input would give.
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    t = (pid // num_col_blocks).to(tl.int64)
    cols = (pid % num_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t * stride_x
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + I + cols, mask=mask, other=0.0)
    if ROW_RMS:
        scale = row_rms_scale(rms_ptr, t, stride_rms, rms_eps, HID, BLOCK_HID)
        gate = (gate.to(tl.float32) * scale).to(gate.dtype)
        up = (up.to(tl.float32) * scale).to(up.dtype)
    g = gate.to(tl.float32)
    # Rounded to the input dtype before the product, as HF's act_fn(gate) * up.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(op: str, x: torch.Tensor, rms_rows: torch.Tensor | None) -> None:
    if not (x.dim() == 2 and x.shape[1] % 2 == 0):
        raise ValueError(f"{op}: x must be [T, 2I], got {tuple(x.shape)}")
    if rms_rows is not None:
        check_rms_rows(op, rms_rows, x)


def check_out(op: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """out must be [T, I] of x's dtype and device with contiguous rows (x: [T, 2I])."""
    T, I = x.shape[0], x.shape[1] // 2
    if not (
        out.shape == (T, I) and out.dtype == x.dtype and out.device == x.device
        and out.stride(1) == 1
    ):  # fmt: skip
        raise ValueError(
            f"{op}: out must be [{T}, {I}] {x.dtype} on {x.device} with contiguous rows, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )


def silu_and_mul(
    x: torch.Tensor,
    rms_rows: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection, Triton kernel.

    Args:
        x: [T, 2I] (bf16/fp16/fp32), columns [:I] the gate, [I:] the up projection; rows
            contiguous.
        rms_rows: [T, H] hidden rows the projection ran on un-normalised, their RMSNorm weight
            folded into its weight: row t of gate and up is first scaled by
            1 / RMS(rms_rows[t]) (fp32, rounded to the dtype). None: x is used as given.
        rms_eps: that RMSNorm's epsilon.
        out: optional [T, I] of x.dtype, rows contiguous, to write into (a buffer at a fixed
            address, e.g. inside an L2 access-policy window); allocated when None.

    Returns:
        [T, I] in x.dtype (out when given).
    """
    op = "silu_and_mul"
    _check_args(op, x, rms_rows)
    if x.stride(1) != 1:
        raise ValueError(f"{op}: x rows must be contiguous, got strides {x.stride()}")
    check_dtype(op, "x", x)
    check_launchable(op, x, *([rms_rows] if rms_rows is not None else []))
    T, I = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    else:
        check_out(op, x, out)
    if T == 0:
        return out
    row_rms = rms_rows is not None
    block = min(_BLOCK_RMS, pow2(I)) if row_rms else _BLOCK
    hid = rms_rows.shape[1] if row_rms else 1
    num_col_blocks = triton.cdiv(I, block)
    pdl = use_pdl(x.device)
    _silu_and_mul_kernel[(T * num_col_blocks,)](
        x, out, rms_rows if row_rms else x, x.stride(0), out.stride(0),
        rms_rows.stride(0) if row_rms else 0, I, num_col_blocks, rms_eps,
        BLOCK=block, ROW_RMS=row_rms, HID=hid, BLOCK_HID=pow2(hid), USE_PDL=pdl,
        num_warps=8 if block >= 2048 else 4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def silu_and_mul_ref(
    x: torch.Tensor, rms_rows: torch.Tensor | None = None, rms_eps: float = 1e-6
) -> torch.Tensor:
    """Torch reference of silu_and_mul, in the input dtype like HF's LlamaMLP (after the row
    scale when rms_rows is given)."""
    _check_args("silu_and_mul", x, rms_rows)
    if rms_rows is not None:
        x = rms_scale_rows_ref(x, rms_rows, rms_eps)
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]
