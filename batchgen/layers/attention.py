"""Attention of a layer: over the paged KV cache from the qkv projection (attend_qkv: the
prologue, rope_and_store_kv, then the attention kernels), or cache-free over the new tokens
alone (forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.kernels import ops
from batchgen.layers.context import AttentionContext

# On CUDA, a mixed step's prompt-chunk attention runs on a side stream beside the decode rows'
# attention. The chunk's kernel is latency-bound (a few programs walking their keys, about
# 18 us a layer on llama3.1-8b) and the decode kernel is bandwidth-bound: side by side, the
# chunk's programs take SM slots the decode kernel's tail leaves idle (llama3.1-8b nano:
# 14.96 s against 15.06 s without it, one sweep). 0 runs both on the current stream.
CHUNK_SIDE_STREAM = 1

# Decode rows (one new token each) run the prologue inside the decode kernel
# (ops.rope_store_decode): one kernel a layer fewer. 0 runs ops.rope_and_store_kv on every
# row first, then the attention kernels.
FUSED_DECODE_PROLOGUE = 1

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class Prologue:
    """The arguments of the attention prologue (ops.rope_and_store_kv) besides qkv, the
    positions and the caches: the rotary table, the q/k norms (Qwen3) and the hidden rows of a
    folded input norm (rms_rows [T, H], or None)."""

    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    rms_rows: torch.Tensor | None = None
    rms_eps: float = 1e-6

    def rows(self, lo: int, hi: int | None = None) -> tuple:
        """The trailing arguments of rope_and_store_kv for rows lo:hi."""
        rms = None if self.rms_rows is None else self.rms_rows[lo:hi]
        return (self.q_norm_weight, self.k_norm_weight, self.eps, rms, self.rms_eps)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class Attention(nn.Module):
    """Causal GQA attention for one layer; the cache itself lives in ctx.kv_caches[layer_idx]."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Cache-free attention (plain forwards): q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D],
        each sequence's new tokens attending to themselves. With a KV cache the model stores
        k/v through ops.rope_and_store_kv and calls attend()."""
        if ctx.kv_caches is not None:
            raise ValueError("Attention.forward is the cache-free path; with a cache use attend()")
        return ops.varlen_attention(q, k, v, ctx.cu_seqlens_q, ctx.max_seqlen_q, self.scale)

    def attend_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        prologue: Prologue,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hk) * D] -> [T, Hq, D]: store this step's k/v in the cache and
        attend over it. Decode rows go through ops.rope_store_decode (the prologue inside the
        decode kernel), prompt rows through ops.rope_and_store_kv and the prompt kernel."""
        caches = ctx.kv_caches[self.layer_idx]  # ([num_blocks, block_size, Hk, D]) x 2
        d = qkv.shape[0] if ctx.is_decode else ctx.num_decode_rows
        if not FUSED_DECODE_PROLOGUE or d == 0:
            q = self._prologue(qkv, positions, ctx.slot_mapping, prologue, caches, 0)
            return self.attend(q, ctx)
        if ctx.is_decode:
            return self._fused_decode(qkv, positions, prologue, caches, ctx, d)
        # Mixed batch: decode rows [0, d) first, prompt chunks after them, each kernel writing
        # its rows of one output. The chunk's prologue runs with its attention (on the side
        # stream), so the decode rows wait for neither.
        out = torch.empty(
            (qkv.shape[0], self.num_heads, self.head_dim), dtype=qkv.dtype, device=qkv.device
        )

        def chunk():
            q = self._prologue(qkv[d:], positions[d:], ctx.slot_mapping[d:], prologue, caches, d)
            self._prefill(
                q, *caches, ctx.prefill_cu_seqlens_q, ctx.prefill_seq_lens,
                ctx.prefill_block_tables, ctx, out=out[d:],
            )  # fmt: skip

        def decode():
            self._fused_decode(qkv[:d], positions[:d], prologue, caches, ctx, d, out=out[:d])

        self._side_by_side(qkv, chunk, decode)
        return out

    def _prologue(self, qkv, positions, slot_mapping, prologue, caches, lo):
        """rope_and_store_kv of rows lo .. lo + len(qkv) of the step; returns their q."""
        return ops.rope_and_store_kv(
            qkv, positions, prologue.cos_sin_cache, self.num_heads, self.num_kv_heads,
            *caches, slot_mapping, *prologue.rows(lo, lo + qkv.shape[0]),
        )  # fmt: skip

    def _fused_decode(self, qkv, positions, prologue, caches, ctx, d, out=None):
        """The first d rows of the step, one new token each: prologue and decode attention."""
        norm_q, norm_k, eps, rms_rows, rms_eps = prologue.rows(0, d)
        return ops.rope_store_decode(
            qkv, positions, prologue.cos_sin_cache, self.num_heads, self.num_kv_heads, *caches,
            ctx.slot_mapping[:d], ctx.seq_lens[:d], ctx.block_tables[:d], self.scale,
            norm_q, norm_k, eps, rms_rows, rms_eps, max_seq_len=ctx.max_seqlen_k, out=out,
        )  # fmt: skip

    def attend(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D] over the paged cache, where this step's k/v are stored."""
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]  # [num_blocks, block_size, Hk, D]
        if ctx.is_decode:
            return self._decode(q, k_cache, v_cache, ctx.seq_lens, ctx.block_tables, ctx)
        d = ctx.num_decode_rows
        if d == 0:
            return self._prefill(
                q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.seq_lens, ctx.block_tables, ctx
            )
        # Mixed batch: single-token rows [0, d) first, prefill chunks after them. Each kernel
        # writes its rows of one output in place (no copies of [T, Hq, D] per layer).
        out = torch.empty_like(q)

        def chunk():
            self._prefill(
                q[d:],
                k_cache,
                v_cache,
                ctx.prefill_cu_seqlens_q,
                ctx.prefill_seq_lens,
                ctx.prefill_block_tables,
                ctx,
                out=out[d:],
            )

        def decode():
            self._decode(
                q[:d], k_cache, v_cache, ctx.seq_lens[:d], ctx.block_tables[:d], ctx, out=out[:d]
            )

        self._side_by_side(q, chunk, decode)
        return out

    @staticmethod
    def _side_by_side(x: torch.Tensor, chunk, decode) -> None:
        """Run chunk() and decode(), the prompt rows' kernels on a side stream on CUDA."""
        if not (x.is_cuda and CHUNK_SIDE_STREAM):
            decode()
            chunk()
            return
        # Fork: the side stream starts after everything before (this layer's projection or
        # cache write); join: the main stream goes on only after the chunk's rows are written.
        # The tensors both use belong to the main stream and outlive the join, so the
        # allocator cannot reuse them early. Under CUDA-graph capture the fork and join become
        # graph edges.
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            chunk()
        decode()
        main.wait_stream(side)

    def _decode(self, q, k_cache, v_cache, seq_lens, block_tables, ctx, out=None):
        return ops.paged_attention_decode(
            q,
            k_cache,
            v_cache,
            seq_lens,
            block_tables,
            self.scale,
            max_seq_len=ctx.max_seqlen_k,
            out=out,
        )

    def _prefill(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, ctx, out=None):
        return ops.paged_attention(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            seq_lens,
            block_tables,
            self.scale,
            ctx.max_seqlen_q,
            out=out,
        )
