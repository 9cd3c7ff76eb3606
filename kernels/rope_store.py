"""The attention prologue in one kernel: split a fused qkv row, RMS-normalise each q/k head
(Qwen3's q/k-norm, optional), rotate q and k (rotary, neox style) and write k and v into the
paged cache by slot (quantized to FP8 e4m3 when the cache is FP8). Triton kernel and torch
reference.

Unfused, a decode step runs up to six kernels per layer here (two copies and two norms for
q/k-norm, rotary, the cache write), each a few microseconds on a few kilobytes per token; at
small batches their launch cost, not their bytes, is the step's time.
"""

from __future__ import annotations

import torch

from .fp8 import check_kv_cache_dtype, quantize_e4m3
from .kv_cache import store_kvcache_ref
from .launch import (
    check_caches,
    check_dtype,
    check_launchable,
    pdl_prologue,
    pow2,
    tl,
    triton,
    use_pdl,
)
from .rms_norm import check_rms_rows, rms_norm_ref, rms_scale_rows_ref, row_rms_scale
from .rotary import check_positions_and_table, rotary_embedding_ref


@triton.jit
def _norm_rope_heads(
    src, dst, w_ptr, cos, sin, eps, H, row_scale, fp8_scale,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr,
    ROW_RMS: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    # H heads of D = 2 * HALF contiguous values at src -> dst, as [BLOCK_H, BLOCK_HALF] halves;
    # cos/sin are [1, BLOCK_HALF] fp32. Roundings as the unfused kernels: the norm's output is
    # rounded to the input dtype, then rotated in fp32 and rounded once more. ROW_RMS first
    # scales the values by row_scale (fp32) and rounds, as a separate kernel would. FP8 (an FP8
    # cache as dst): the rotated values, rounded to the input dtype, are quantized with
    # fp8_scale, as the store of an unfused kernel's output would be.
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (d < HALF)
    offs = heads * (2 * HALF) + d
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0)
    if ROW_RMS:
        x1 = (x1.to(tl.float32) * row_scale).to(x1.dtype)
        x2 = (x2.to(tl.float32) * row_scale).to(x2.dtype)
    if QK_NORM:
        h1 = x1.to(tl.float32)
        h2 = x2.to(tl.float32)
        var = (tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (h1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        x2 = (w2 * (h2 * r).to(x2.dtype).to(tl.float32)).to(x2.dtype)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if FP8:
        y1 = quantize_e4m3((a * cos - b * sin).to(x1.dtype), fp8_scale)
        y2 = quantize_e4m3((b * cos + a * sin).to(x1.dtype), fp8_scale)
    else:
        y1 = (a * cos - b * sin).to(dst.dtype.element_ty)
        y2 = (b * cos + a * sin).to(dst.dtype.element_ty)
    tl.store(dst + offs, y1, mask=mask)
    tl.store(dst + offs + HALF, y2, mask=mask)


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr, pos_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    rms_ptr, kv_scale_ptr, stride_t, stride_cos_sin, stride_qo, stride_rms, eps, rms_eps,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
    QK_NORM: tl.constexpr, ROW_RMS: tl.constexpr, HID: tl.constexpr, BLOCK_HID: tl.constexpr,
    FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # One program per token t: its qkv row is [q: HQ * D | k: HK * D | v: HK * D]. q goes to
    # q_out[t]; k and v go to cache slot slot[t] (a [HK, D] row of the [NB, BS, HK, D] caches),
    # unless slot[t] < 0 (padding). ROW_RMS: the projection ran on the un-normalised hidden row
    # t of rms_ptr [T, HID] (its RMSNorm weight folded into the weights), so the whole qkv row
    # is first scaled by that row's 1 / RMS. FP8: the caches are e4m3, k and v are stored
    # divided by kv_scale_ptr's [k_scale, v_scale].
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    row_scale = 1.0
    if ROW_RMS:
        row_scale = row_rms_scale(rms_ptr, t, stride_rms, rms_eps, HID, BLOCK_HID)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0)[None, :]
    src = qkv_ptr + t * stride_t
    _norm_rope_heads(src, q_out_ptr + t * stride_qo, q_w_ptr, cos, sin, eps, HQ, row_scale,
                     1.0, HALF, BLOCK_HQ, BLOCK_HALF, QK_NORM, ROW_RMS, False)  # fmt: skip
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        kv_row = HK * 2 * HALF
        k_scale = 1.0
        v_scale = 1.0
        if FP8:
            k_scale = tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
        _norm_rope_heads(src + HQ * 2 * HALF, k_cache_ptr + slot * kv_row, k_w_ptr, cos, sin,
                         eps, HK, row_scale, k_scale, HALF, BLOCK_HK, BLOCK_HALF, QK_NORM,
                         ROW_RMS, FP8)  # fmt: skip
        cols = tl.arange(0, BLOCK_KV)
        v = tl.load(src + (HQ + HK) * 2 * HALF + cols, mask=cols < kv_row)
        if ROW_RMS:
            v = (v.to(tl.float32) * row_scale).to(v.dtype)
        if FP8:
            v = quantize_e4m3(v, v_scale)
        tl.store(v_cache_ptr + slot * kv_row + cols, v, mask=cols < kv_row)


def _check_args(op, qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_cache, v_cache,
                slot_mapping, q_norm_weight, k_norm_weight, rms_rows,
                kv_scale) -> bool:  # fmt: skip
    check_caches(op, k_cache, v_cache)
    if rms_rows is not None:
        check_rms_rows(op, rms_rows, qkv)
    hk, d = k_cache.shape[2], k_cache.shape[3]
    if hk != num_kv_heads:
        raise ValueError(f"{op}: cache has {hk} kv heads, expected num_kv_heads={num_kv_heads}")
    width = (num_heads + 2 * num_kv_heads) * d
    if not (qkv.dim() == 2 and qkv.shape[1] == width):
        raise ValueError(
            f"{op}: qkv must be [T, (Hq + 2 Hk) * D] = [T, {width}], got {tuple(qkv.shape)}"
        )
    if d % 2:
        raise ValueError(f"{op}: head_dim {d} must be even")
    T = qkv.shape[0]
    check_positions_and_table(op, positions, cos_sin_cache, T, d)
    if not (slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64):
        raise ValueError(
            f"{op}: slot_mapping must be [{T}] int64, "
            f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    fp8 = check_kv_cache_dtype(op, qkv.dtype, k_cache, v_cache, kv_scale)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{op}: pass both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and w.shape != (d,):
            raise ValueError(f"{op}: {name} must be [{d}], got {tuple(w.shape)}")
    return fp8


def rope_and_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rms_rows: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q/k-norm (optional), rotary and the cache write of a fused qkv projection, one Triton
    kernel; the same values as rms_norm, rotary_embedding and store_kvcache in turn.

    Args:
        qkv: [T, (Hq + 2 Hk) * D] (bf16/fp16/fp32), rows contiguous: q, k, v heads in order.
        positions: [T] int64 absolute positions, each < max_pos.
        cos_sin_cache: [max_pos, D] float32 from build_cos_sin_cache.
        num_heads, num_kv_heads: Hq and Hk.
        k_cache, v_cache: [NB, BS, Hk, D], contiguous, qkv's dtype or float8_e4m3fn; written
            in place.
        slot_mapping: [T] int64, slot = block_id * BS + offset; slots < 0 are not written.
        q_norm_weight, k_norm_weight: [D] RMSNorm weights applied to every q / k head before
            the rotation (Qwen3), or both None.
        eps: the norm's epsilon.
        rms_rows: [T, H] hidden rows the projection ran on un-normalised, their RMSNorm weight
            folded into its weight (see `fold_rms_weight`): every qkv row t is first scaled by
            1 / RMS(rms_rows[t]) (fp32, rounded to the dtype). None: qkv is used as given.
        rms_eps: that RMSNorm's epsilon.
        kv_scale: FP8 caches only: [2] float32 (k_scale, v_scale); k and v (rotated, in qkv's
            dtype) are stored as store_kvcache quantizes them.

    Returns:
        q: [T, Hq, D] rotated (and normalised), a new contiguous tensor in qkv's dtype.
    """
    op = "rope_and_store_kv"
    fp8 = _check_args(op, qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_cache,
                      v_cache, slot_mapping, q_norm_weight, k_norm_weight, rms_rows,
                      kv_scale)  # fmt: skip
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{op}: qkv and cos_sin_cache rows must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    check_dtype(op, "qkv", qkv)
    norm = q_norm_weight is not None
    if norm and not (q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()):
        raise ValueError(f"{op}: norm weights must be contiguous")
    tensors = [qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping]
    tensors += [q_norm_weight, k_norm_weight] if norm else []
    tensors += [rms_rows] if rms_rows is not None else []
    check_launchable(op, *tensors, *([kv_scale] if fp8 else []))
    T, D = qkv.shape[0], k_cache.shape[3]
    q_out = torch.empty((T, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q_out
    block_hq, block_half = pow2(num_heads), pow2(D // 2)
    row_rms = rms_rows is not None
    hid = rms_rows.shape[1] if row_rms else 1
    pdl = use_pdl(qkv.device)
    _rope_store_kv_kernel[(T,)](
        qkv, positions, cos_sin_cache,
        q_norm_weight if norm else qkv, k_norm_weight if norm else qkv,
        slot_mapping, q_out, k_cache, v_cache, rms_rows if row_rms else qkv,
        kv_scale if fp8 else qkv,
        qkv.stride(0), cos_sin_cache.stride(0), q_out.stride(0),
        rms_rows.stride(0) if row_rms else 0, eps, rms_eps,
        HQ=num_heads, HK=num_kv_heads, HALF=D // 2, BLOCK_HQ=block_hq,
        BLOCK_HK=pow2(num_kv_heads), BLOCK_HALF=block_half, BLOCK_KV=pow2(num_kv_heads * D),
        QK_NORM=norm, ROW_RMS=row_rms, HID=hid, BLOCK_HID=pow2(hid), FP8=fp8, USE_PDL=pdl,
        num_warps=4 if block_hq * block_half >= 2048 else 2, launch_pdl=pdl,
    )  # fmt: skip
    return q_out


def rope_and_store_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rms_rows: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of rope_and_store_kv: the row scale (if any), then the references of the
    three unfused ops in turn."""
    _check_args("rope_and_store_kv", qkv, positions, cos_sin_cache, num_heads, num_kv_heads,
                k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight,
                rms_rows, kv_scale)  # fmt: skip
    if rms_rows is not None:
        qkv = rms_scale_rows_ref(qkv, rms_rows, rms_eps)
    T, D = qkv.shape[0], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = q.reshape(T, num_heads, D)
    k = k.reshape(T, num_kv_heads, D)
    v = v.reshape(T, num_kv_heads, D)
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q
