"""Attention of a layer: over the paged KV cache (attend; the model has stored this step's K/V with
ops.rope_and_store_kv), or cache-free over the new tokens alone (forward). An FP8 cache is read
and written with the layer's K/V scales (`kv_scale`)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels import ops
from batchgen.kernels.fp8 import FP8_DTYPE, FP8_MAX
from batchgen.layers.context import AttentionContext

# On CUDA, a mixed step's prompt-chunk attention runs on a side stream beside the decode rows'
# attention. The chunk's kernel is latency-bound (a few programs walking their keys, about
# 18 us a layer on llama3.1-8b) and the decode kernel is bandwidth-bound: side by side, the
# chunk's programs take SM slots the decode kernel's tail leaves idle (llama3.1-8b nano:
# 14.96 s against 15.06 s without it, one sweep). 0 runs both on the current stream.
CHUNK_SIDE_STREAM = 1

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class Attention(nn.Module):
    """Causal GQA attention for one layer; the cache itself lives in ctx.kv_caches[layer_idx].

    kv_scale: [2] float32 (k_scale, v_scale), the dequantization scales of this layer's K and V
    in an FP8 cache (cache = round(k / k_scale)); 1.0 until a checkpoint's scales or a
    calibration set them. Kernels read it from device memory, so a change needs no new CUDA
    graph. kv_amax: while observing (observe_kv_range), the running max |k| and |v| [2] of the
    cache-free forwards.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        self.kv_amax: torch.Tensor | None = None

    def cache_scale(self, cache: torch.Tensor) -> torch.Tensor | None:
        """kv_scale for an FP8 cache, None for a cache in the activations' dtype."""
        return self.kv_scale if cache.dtype == FP8_DTYPE else None

    def observe_kv_range(self, on: bool) -> None:
        """Start (zeroed) or stop recording max |k|, |v| in forward (KV-scale calibration)."""
        self.kv_amax = (
            torch.zeros(2, dtype=torch.float32, device=self.kv_scale.device) if on else None
        )

    def scales_from_range(self) -> torch.Tensor:
        """[2] float32 scales that map the observed max |k|, |v| to e4m3's largest value (1.0
        where nothing above 0 was seen)."""
        amax = self.kv_amax if self.kv_amax is not None else torch.zeros(2)
        return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Cache-free attention (plain forwards): q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D],
        each sequence's new tokens attending to themselves. With a KV cache the model stores
        k/v through ops.rope_and_store_kv and calls attend()."""
        if ctx.kv_caches is not None:
            raise ValueError("Attention.forward is the cache-free path; with a cache use attend()")
        if self.kv_amax is not None:
            seen = torch.stack([k.abs().amax().float(), v.abs().amax().float()])
            torch.maximum(self.kv_amax, seen, out=self.kv_amax)
        return ops.varlen_attention(q, k, v, ctx.cu_seqlens_q, ctx.max_seqlen_q, self.scale)

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

        if not (q.is_cuda and CHUNK_SIDE_STREAM):
            decode()
            chunk()
            return out
        # Fork: the side stream starts after everything before (this layer's cache write);
        # join: the main stream goes on only after the chunk's rows are written. q and out
        # belong to the main stream and outlive the join, so the allocator cannot reuse them
        # early. Under CUDA-graph capture the fork and join become graph edges.
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            chunk()
        decode()
        main.wait_stream(side)
        return out

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
            kv_scale=self.cache_scale(k_cache),
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
            kv_scale=self.cache_scale(k_cache),
        )
