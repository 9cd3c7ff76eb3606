"""AttentionContext: the per-step batch metadata built by the model runner, read by attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionContext:
    """Describes one forward step over a ragged batch of B sequences with T new tokens in all.

    Sequence b contributes q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens, placed at
    positions seq_lens[b] - q_len_b ... seq_lens[b] - 1 of its context; each attends causally to
    its whole context (cached prefix + the new tokens themselves).

    Attributes:
        cu_seqlens_q: [B+1] int32, offsets of each sequence's new tokens in the flat batch.
        seq_lens: [B] int32, context length of each sequence after this step (cached + new).
        max_seqlen_q: max q_len_b (host int, so kernels can size their grids without a sync).
        max_seqlen_k: max seq_lens[b] (host int).
        slot_mapping: [T] int64, KV-cache slot (block_id * block_size + offset) of each new
            token; -1 means "do not store" (padding).
        block_tables: [B, max_blocks_per_seq] int32, the cache blocks of each sequence in order
            (unused entries padded with 0).
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads,
            head_dim]; None runs attention over the new tokens alone (no cache, seq_lens must
            equal the q lengths) — used by plain forwards in tests.
        is_decode: every sequence has exactly one new token (decode kernels, CUDA graphs).
        num_decode_rows: in a mixed batch, the leading sequences 0 .. num_decode_rows - 1 that
            have exactly one new token each; attention runs them through the split-KV decode
            kernel (K/V read once per GQA group) and only the rest through the prefill kernel.
        prefill_cu_seqlens_q / prefill_seq_lens / prefill_block_tables: cu_seqlens_q (rebased
            to 0), seq_lens and block_tables of the remaining rows (set when num_decode_rows > 0
            and rows remain).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    is_decode: bool = False
    num_decode_rows: int = 0
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None

    @classmethod
    def for_prompts(
        cls, lengths: list[int], device: torch.device | str = "cpu"
    ) -> AttentionContext:
        """A cache-free context for a ragged batch of whole prompts (tests, plain forwards)."""
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        return cls(
            cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
        )
