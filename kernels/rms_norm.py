"""RMSNorm and residual-add + RMSNorm (HF LlamaRMSNorm semantics): Triton kernel and reference."""

from __future__ import annotations

import torch

from .launch import check_dtype, check_launchable, pow2, tl, triton


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out, T, H, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # ROWS whole rows per program, each [H <= BLOCK] in registers; several rows per program
    # when H is small (e.g. Qwen3's per-head q/k norm, H = 128).
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < T) & (cols < H)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0)
        # HF adds in the activation dtype: round the sum before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=1) / H
    normed = (h * tl.rsqrt(var + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    # HF multiplies by the weight after casting back: one rounding of an exact fp32 product.
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, H], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{op}: weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"{op}: x rows must be contiguous (stride(1) == 1), got {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous")
    check_dtype(op, "x", x)
    check_dtype(op, "weight", weight)
    check_launchable(op, x, weight)


def _launch(x, residual, weight, eps, out, res_out) -> None:
    T, H = x.shape
    if T == 0:
        return
    block = pow2(H)
    rows = max(1, 4096 // block)  # about 4k elements per program
    num_warps = min(max(rows * block // 512, 1), 16)
    _rms_norm_kernel[(triton.cdiv(T, rows),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        T,
        H,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row, Triton kernel.

    Args:
        x: [T, H] activations (bf16/fp16/fp32), rows contiguous.
        weight: [H] scale.
        eps: added to the mean square.

    Returns:
        [T, H] in x.dtype: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32.
    """
    _check_args("rms_norm", x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass, Triton kernel.

    Args:
        x: [T, H] layer output.
        residual: [T, H] running residual stream, same dtype as x.
        weight: [H] scale.
        eps: added to the mean square.

    Returns:
        (normed [T, H], new_residual [T, H]) with new_residual = x + residual (in x.dtype) and
        normed = rms_norm(new_residual).
    """
    op = "fused_add_rms_norm"
    _check_args(op, x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"{op}: residual dtype {residual.dtype} != x dtype {x.dtype}")
    if residual.stride(1) != 1:
        raise ValueError(f"{op}: residual rows must be contiguous, got {residual.stride()}")
    check_launchable(op, x, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of rms_norm, exactly HF LlamaRMSNorm.forward (any leading dims)."""
    h = x.float() * rms_row_scale_ref(x, eps)
    return (weight * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of fused_add_rms_norm: HF's `hidden = residual + hidden`, then the norm."""
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual


# ---- RMSNorm folded into the next projection ---------------------------------------------------
# norm(x) @ W.T == (x @ (W * weight).T) * rsqrt(mean(x^2) + eps) row by row: with the norm's
# weight folded into the projection's input columns, the projection runs on the un-normalised
# rows and the kernel that consumes its output (rope_and_store_kv, silu_and_mul) applies the
# row's 1 / RMS, so no norm kernel runs between the residual add and the projection.


@triton.jit
def row_rms_scale(rows_ptr, t, stride_row, eps, HID: tl.constexpr, BLOCK_HID: tl.constexpr):
    # 1 / RMS of row t of a [T, HID] tensor, fp32: rsqrt(mean(x^2) + eps), as RMSNorm's; the
    # scale the kernels after a folded projection apply (rms_rows).
    cols = tl.arange(0, BLOCK_HID)
    x = tl.load(rows_ptr + t * stride_row + cols, mask=cols < HID, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / HID + eps)


def check_rms_rows(op: str, rms_rows: torch.Tensor, y: torch.Tensor) -> None:
    """rms_rows must be [T, H] in y's dtype with contiguous rows, T = y.shape[0]."""
    if not (rms_rows.dim() == 2 and rms_rows.shape[0] == y.shape[0]):
        raise ValueError(f"{op}: rms_rows must be [{y.shape[0]}, H], got {tuple(rms_rows.shape)}")
    if rms_rows.dtype != y.dtype:
        raise ValueError(f"{op}: rms_rows dtype {rms_rows.dtype} != {y.dtype}")
    if rms_rows.stride(1) != 1:
        raise ValueError(f"{op}: rms_rows rows must be contiguous, got {rms_rows.stride()}")


def rms_row_scale_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS of each row of x [T, H] as RMSNorm computes it: [T, 1] float32."""
    h = x.float()
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_scale_rows_ref(y: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, N] scaled row by row by 1 / RMS(x [T, H]) in fp32, rounded to y's dtype."""
    return (y.float() * rms_row_scale_ref(x, eps)).to(y.dtype)
