"""Write new tokens' K/V into the paged cache by slot (quantized when the cache is FP8): Triton
kernel and reference."""

from __future__ import annotations

import torch

from .fp8 import check_kv_cache_dtype, quantize_e4m3, quantize_fp8_ref
from .launch import check_caches, check_dtype, check_launchable, pow2, tl, triton


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    kv_scale_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per token: copy its [Hk * D] row of K and of V into cache slot `slot`; FP8
    # caches get k / k_scale and v / v_scale rounded to e4m3 (kv_scale_ptr: [k_scale, v_scale]).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    if FP8:
        k = quantize_e4m3(k, tl.load(kv_scale_ptr))
        v = quantize_e4m3(v, tl.load(kv_scale_ptr + 1))
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)


def _check_args(k, v, k_cache, v_cache, slot_mapping, kv_scale) -> bool:
    op = "store_kvcache"
    if not (k.dim() == 3 and k.shape == v.shape):
        raise ValueError(
            f"{op}: k and v must be [T, Hk, D], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_caches(op, k_cache, v_cache)
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"{op}: cache [.., .., Hk, D] = {tuple(k_cache.shape[2:])} "
            f"does not match k {tuple(k.shape[1:])}"
        )
    if k.dtype != v.dtype:
        raise ValueError(f"{op}: k and v must share a dtype, got {k.dtype}, {v.dtype}")
    fp8 = check_kv_cache_dtype(op, k.dtype, k_cache, v_cache, kv_scale)
    if not (slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64):
        raise ValueError(
            f"{op}: slot_mapping must be [{k.shape[0]}] int64, "
            f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    return fp8


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V at its cache slot, in place, Triton kernel.

    Args:
        k, v: [T, Hk, D]; each token's [Hk, D] contiguous (views of a fused qkv are fine).
        k_cache, v_cache: [NB, BS, Hk, D], contiguous, k's dtype or float8_e4m3fn.
        slot_mapping: [T] int64, slot = block_id * BS + offset; slots < 0 are skipped.
        kv_scale: FP8 caches only: [2] float32 (k_scale, v_scale); the cache holds
            round_e4m3(clamp(k / k_scale, -448, 448)) (kernels/fp8.py).
    """
    op = "store_kvcache"
    fp8 = _check_args(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    Hk, D = k.shape[1], k.shape[2]
    for name, t in (("k", k), ("v", v)):
        if not (t.stride(2) == 1 and t.stride(1) == D):
            raise ValueError(
                f"{op}: {name}[t] must be contiguous [Hk, D], got strides {t.stride()}"
            )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    check_dtype(op, "k", k)
    check_launchable(op, k, v, k_cache, v_cache, slot_mapping, *([kv_scale] if fp8 else []))
    if k.shape[0] == 0:
        return
    row = Hk * D
    _store_kvcache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, kv_scale if fp8 else slot_mapping,
        k.stride(0), v.stride(0),
        ROW=row, BLOCK=pow2(row), FP8=fp8, num_warps=4 if row >= 1024 else 1,
    )  # fmt: skip


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference of store_kvcache (in place; slots < 0 skipped; FP8 caches get
    quantize_fp8_ref(k, k_scale), quantize_fp8_ref(v, v_scale))."""
    fp8 = _check_args(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    Hk, D = k.shape[1], k.shape[2]
    k, v = k[keep], v[keep]
    if fp8:
        k, v = quantize_fp8_ref(k, kv_scale[0]), quantize_fp8_ref(v, kv_scale[1])
    k_cache.view(-1, Hk, D)[slots] = k
    v_cache.view(-1, Hk, D)[slots] = v
