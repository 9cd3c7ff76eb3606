"""Rotary position embedding (neox / HF rotate_half style): cos/sin cache builder, Triton kernel
and reference."""

from __future__ import annotations

import math

import torch

from .launch import check_dtype, check_launchable, pow2, tl, triton


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    # Exactly HF's computation (modeling_rope_utils), fp32 on the CPU.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed, inv_freq_llama)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def build_cos_sin_cache(
    head_dim: int, max_position: int, base: float, scaling: dict | None = None
) -> torch.Tensor:
    """Precompute the rotary table on the CPU, as HF's rotary embedding computes it.

    Args:
        head_dim: D, even.
        max_position: number of positions to cover.
        base: rope_theta.
        scaling: the config's rope_scaling dict (key "rope_type" or legacy "type": "default",
            "linear" with factor, "llama3" with factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings), or None.

    Returns:
        [max_position, D] float32: columns [:D/2] are cos, [D/2:] are sin of position * inv_freq.

    Raises:
        ValueError: head_dim is odd or the rope type is not supported (e.g. "dynamic").
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim={head_dim} must be even")
    inv_freq = _inv_freq(head_dim, base, scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin, H,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # x[t] as [BLOCK_H heads, BLOCK_HALF] halves; cos/sin are [BLOCK_HALF] fp32.
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (d < HALF)
    src = x_ptr + t * stride_xt + heads * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = out_ptr + t * stride_ot + heads * stride_oh + d
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    HQ, HK,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # One program per token: every q and k head of that token, cos/sin loaded once.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=d < HALF, other=0.0)
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, HQ,
                  HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, HK,
                  HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def check_positions_and_table(
    op: str, positions: torch.Tensor, cos_sin_cache: torch.Tensor, T: int, D: int
) -> None:
    """positions must be [T] int64 and cos_sin_cache [max_pos, D] float32 (build_cos_sin_cache);
    shared by the launchers that rotate."""
    if not (positions.shape == (T,) and positions.dtype == torch.int64):
        raise ValueError(
            f"{op}: positions must be [{T}] int64, got {tuple(positions.shape)} {positions.dtype}"
        )
    if not (
        cos_sin_cache.dim() == 2
        and cos_sin_cache.shape[1] == D
        and cos_sin_cache.dtype == torch.float32
    ):
        raise ValueError(
            f"{op}: cos_sin_cache must be [max_pos, {D}] float32, "
            f"got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}"
        )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions, Triton kernel (fp32 math, one rounding).

    Args:
        positions: [T] int64 absolute positions, each < max_pos.
        q: [T, Hq, D] (bf16/fp16/fp32), last dim contiguous (a view of a fused qkv is fine).
        k: [T, Hk, D], same dtype.
        cos_sin_cache: [max_pos, D] float32 from build_cos_sin_cache.

    Returns:
        (q_out [T, Hq, D], k_out [T, Hk, D]), new contiguous tensors in the input dtype.
    """
    op = "rotary_embedding"
    if not (q.dim() == 3 and k.dim() == 3):
        raise ValueError(f"{op}: q and k must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    T, HQ, D = q.shape
    if not (k.shape[0] == T and k.shape[2] == D):
        raise ValueError(f"{op}: k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if D % 2 != 0:
        raise ValueError(f"{op}: head_dim {D} must be even")
    check_positions_and_table(op, positions, cos_sin_cache, T, D)
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{op}: cos_sin_cache rows must be contiguous")
    if not (q.stride(2) == 1 and k.stride(2) == 1):
        raise ValueError(
            f"{op}: q and k need a contiguous last dim, got strides {q.stride()}, {k.stride()}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"{op}: q dtype {q.dtype} != k dtype {k.dtype}")
    check_dtype(op, "q", q)
    check_launchable(op, positions, q, k, cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    HK = k.shape[1]
    block_hq, block_hk, block_half = pow2(HQ), pow2(HK), pow2(D // 2)
    _rotary_kernel[(T,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        HQ, HK,
        HALF=D // 2, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half >= 2048 else 2,
    )  # fmt: skip
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of rotary_embedding: HF apply_rotary_pos_emb, cos/sin cast to q.dtype."""
    half = q.shape[-1] // 2
    rows = cos_sin_cache[positions]  # [T, D]
    cos = torch.cat([rows[:, :half], rows[:, :half]], dim=-1).to(q.dtype)[:, None, :]
    sin = torch.cat([rows[:, half:], rows[:, half:]], dim=-1).to(q.dtype)[:, None, :]
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed
