"""Decode attention straight from the fused qkv projection: rope_and_store_kv folded into the
split-KV decode kernel (its ROPE mode). Triton launcher and torch reference.

A decode step otherwise runs rope_and_store_kv and then paged_attention_decode in every layer;
at decode sizes the first is a few microseconds of launch and ramp for a few kilobytes. Here
each decode program normalises and rotates its own q heads, and the program whose split ends
the sequence attends the new key/value from registers and writes them to the cache. Mixed and
prefill steps keep the two ops.
"""

from __future__ import annotations

import torch

from .decode_attention import (
    DecodeRope,
    check_decode_args,
    decode_tiles,
    launch_decode,
    paged_attention_decode_ref,
    resolve_splits,
)
from .launch import check_launchable
from .rope_store import check_rope_store_args, rope_and_store_kv_ref


def paged_attention_decode_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """rope_and_store_kv then paged_attention_decode, one split kernel (plus the reduce when
    splitting); CUDA-graph safe like paged_attention_decode.

    Args:
        qkv: [B, (Hq + 2 Hk) * D] one new token per sequence, rows contiguous.
        positions: [B] int64, the new token's position (seq_lens[b] - 1 for real rows).
        cos_sin_cache, num_heads, num_kv_heads, slot_mapping, q_norm_weight, k_norm_weight,
            eps: as rope_and_store_kv; k_cache / v_cache get the new k/v at slot_mapping.
        seq_lens, block_tables, scale, num_splits, max_seq_len: as paged_attention_decode;
            seq_lens counts the new token, whose key the cache does not hold yet.

    Returns:
        [B, Hq, D] in qkv's dtype.
    """
    op = "paged_attention_decode_rope"
    check_rope_store_args(op, qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_cache,
                          v_cache, slot_mapping, q_norm_weight, k_norm_weight)  # fmt: skip
    if qkv.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"{op}: qkv and cos_sin_cache rows must be contiguous")
    norm = q_norm_weight is not None
    if norm and not (q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()):
        raise ValueError(f"{op}: norm weights must be contiguous")
    B, D = qkv.shape[0], k_cache.shape[3]
    check_decode_args(op, qkv, B, num_heads, D, k_cache, v_cache, seq_lens, block_tables)
    check_launchable(op, qkv, positions, cos_sin_cache, slot_mapping,
                     *([q_norm_weight, k_norm_weight] if norm else []))  # fmt: skip
    num_splits = resolve_splits(op, num_splits, max_seq_len, k_cache, block_tables)
    rope = DecodeRope(num_heads, positions, cos_sin_cache, slot_mapping, q_norm_weight,
                      k_norm_weight, eps)  # fmt: skip
    return launch_decode(qkv, k_cache, v_cache, seq_lens, block_tables, scale, num_splits,
                         *decode_tiles(), rope=rope)  # fmt: skip


def paged_attention_decode_rope_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Torch reference of paged_attention_decode_rope: the two references in turn."""
    q = rope_and_store_kv_ref(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_cache,
                              v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps)  # fmt: skip
    return paged_attention_decode_ref(q, k_cache, v_cache, seq_lens, block_tables, scale)
