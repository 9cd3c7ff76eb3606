"""MixedGraphs: CUDA graphs of decode steps that carry a prompt chunk (mixed_chunk_tokens).

With mixed_chunk_tokens = P the scheduler fills decode steps with up to P prompt tokens of up to
MIXED_CHUNK_SEQS prompts. Launched eagerly, such a step costs the host a few hundred kernel
launches, more than the GPU time it saves; so each decode bucket bs gets one graph over bs
decode rows followed by P chunk rows, with the chunk's prefill attention sized for
MIXED_CHUNK_SEQS sequences of up to P new tokens each (the kernel's programs past a sequence's
tokens return at once, so any split of the chunk runs in the same graph).

Padding rows ride: the scheduler gives a step with d decode rows up to P + (bs - d) prompt tokens
(riding_rows); the c - P tokens past P sit in the decode bucket's padding rows [d, bs). There
each is a decode row of its prompt: one query at its position over its prompt's keys, which this
step's cache write (before either attention kernel) has stored up to it; the chunk rows hold the
rest (MixedGraphs._layout picks which). The projections compute the padding rows anyway, so
those tokens cost only their attention: fewer prompt tokens are left to due (eager) steps.

Padding left over: decode rows store nothing (slot -1) and attend to one dummy key, as in
DecodeGraphs; chunk rows past the step's tokens belong to no sequence (the chunk's cu_seqlens end
before them), store nothing, and their results are never read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchgen.engine.cuda_graph import (
    bucket_sizes,
    capture_forward,
    graph_table_width,
    smallest_bucket,
)
from batchgen.engine.prompt_allowance import MIXED_CHUNK_SEQS
from batchgen.engine.step_inputs import StepInputs, pad_block_tables
from batchgen.layers.context import AttentionContext

# Mixed graphs' decode buckets past 16 rows are the multiples of this many rows (the decode
# graphs' step by 16 from 16). With P = 128 a bucket's rows plus the chunk's are then a multiple
# of 32, and the padding rows, which carry prompt tokens (RIDE_PADDING_ROWS), are up to 31.
# llama3.1-8b nano on the H100 (2026-11-24, baee805, same-process A/B over 8 builds each):
# 14.13 s median against 14.21 s with buckets every 8 (padding up to 7), and 14.25 s with
# multiples of 64. Every 8 had beaten every 16 by 0.3% before padding rows carried prompts.
MIXED_BUCKET_STEP = 32


# Prompt tokens past P ride in a mixed step's padding decode rows (riding_rows); 0 leaves those
# rows empty, as before b749dde (for A/B runs).
RIDE_PADDING_ROWS = 1

# With tensor parallel, 0 captures no mixed graphs: mixed steps run eagerly, and
# mixed_chunk_tokens=None (auto) resolves to 0, as eager mixed steps cost more host time than
# they hide. 1 captures them as on one GPU (their collectives are the decode graphs', on the
# capturing stream after the chunk's side stream has joined). Rank 0's value holds for every
# rank. tests/gpu/test_tensor_parallel_gpu.py checks tensor parallel 2 against 1 either way.
TENSOR_PARALLEL_MIXED_GRAPHS = 0


def mixed_bucket_sizes(max_batch: int) -> list[int]:
    """The decode buckets the mixed graphs are captured for (1, 2, 4, 8, 16, then multiples of
    MIXED_BUCKET_STEP, and max_batch)."""
    return bucket_sizes(max_batch, MIXED_BUCKET_STEP)


def padding_rows(sizes: list[int], d: int) -> int:
    """Padding decode rows of a step with d decode rows in buckets `sizes` (ascending): bs - d,
    0 for no decode rows or past the largest bucket (no graph runs those)."""
    if not 0 < d <= sizes[-1]:
        return 0
    return smallest_bucket(sizes, d) - d


class MixedGraphs:
    """Captured forwards for d decode rows (bucket bs >= d) + a chunk of <= P + bs - d prompt
    tokens (those past P in the padding rows [d, bs)).

    Args:
        model: the causal LM (forward(input_ids, positions, ctx) -> hidden [T, H]).
        kv_caches: per-layer (k_cache, v_cache) the graphs read and write.
        decode_sizes: the decode buckets (mixed_bucket_sizes); each gets a graph.
        chunk_tokens: P, the chunk rows of every graph.
        max_model_len: longest context; sizes the block tables and the decode splits.
        block_size: tokens per KV block.
        stage: (values, dtype) -> device tensor without a host sync.
        pool: a CUDA graph memory pool to share (the decode graphs'; steps never overlap).
        on_bucket: called with each bucket before its graph is warmed up and captured.
    """

    def __init__(
        self,
        model,
        kv_caches,
        decode_sizes: list[int],
        chunk_tokens: int,
        max_model_len: int,
        block_size: int,
        stage,
        pool=None,
        on_bucket: Callable[[int], None] | None = None,
    ):
        device = kv_caches[0][0].device
        self.sizes = list(decode_sizes)
        self.chunk = chunk_tokens
        self.max_model_len = max_model_len
        self.max_blocks = graph_table_width(max_model_len, block_size)
        n, k = self.sizes[-1], MIXED_CHUNK_SEQS
        # Static inputs. tokens [3, n + P]: input ids, positions, slots (decode rows, then the
        # chunk at row bs of each graph). meta [n + 2k + 1] int32: the decode rows' context
        # lengths [n], the chunk's context lengths [k] and cu_seqlens [k + 1]. tables
        # [n + k, max_blocks]: the decode rows' block tables, then the chunk's.
        self.tokens = torch.zeros(3, n + self.chunk, dtype=torch.int64, device=device)
        self.tokens[2] = -1
        self.meta = torch.ones(n + 2 * k + 1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n + k, self.max_blocks, dtype=torch.int32, device=device)
        self.stage = stage
        self.replays: dict = {}  # bucket -> () -> hidden [bs + P, H]
        self._capture(model, kv_caches, pool, on_bucket)

    def _context(self, bs: int, kv_caches) -> AttentionContext:
        n, k, p = self.sizes[-1], MIXED_CHUNK_SEQS, self.chunk
        return AttentionContext(
            cu_seqlens_q=self.meta[:0],  # unused by a mixed step's attention
            seq_lens=self.meta[:bs],
            max_seqlen_q=p,
            max_seqlen_k=self.max_model_len,
            slot_mapping=self.tokens[2, : bs + p],
            block_tables=self.tables[:bs],
            kv_caches=kv_caches,
            num_decode_rows=bs,
            prefill_cu_seqlens_q=self.meta[n + k :],
            prefill_seq_lens=self.meta[n : n + k],
            prefill_block_tables=self.tables[n:],
        )

    @torch.inference_mode()
    def _capture(self, model, kv_caches, pool, on_bucket=None) -> None:
        """One graph per bucket on CUDA. On CPU (tests of the layout) each bucket runs the model
        eagerly over the same static buffers instead."""
        cuda = self.tokens.is_cuda
        n, k, p = self.sizes[-1], MIXED_CHUNK_SEQS, self.chunk
        # While capturing, the chunk is one whole prompt of P tokens.
        self.meta[n : n + k] = p
        self.meta[n + k :] = torch.tensor([0] + [p] * k, dtype=torch.int32)
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            rows = bs + p
            if on_bucket is not None:
                on_bucket(bs)
            ctx = self._context(bs, kv_caches)
            args = (self.tokens[0, :rows], self.tokens[1, :rows], ctx)
            if not cuda:
                self.replays[bs] = lambda args=args: model(*args)
                continue
            graph, out = capture_forward(model, args, pool)  # out: [rows, H]
            pool = graph.pool()
            self.replays[bs] = lambda graph=graph, out=out: (graph.replay(), out)[1]
        if cuda:
            torch.cuda.synchronize()

    def riding_rows(self, d: int) -> int:
        """Prompt tokens a step with d decode rows may carry beyond P: its bucket's padding
        decode rows, bs - d (0 past the largest bucket, where no graph runs, or with
        RIDE_PADDING_ROWS off)."""
        return padding_rows(self.sizes, d) if RIDE_PADDING_ROWS else 0

    def can_run(self, step: StepInputs) -> bool:
        """Decode rows, then 1..MIXED_CHUNK_SEQS prompt chunks of <= P + riding_rows tokens
        in all."""
        d = step.num_decode_rows
        num_chunks = len(step.seq_lens) - d
        return (
            0 < d <= self.sizes[-1]
            and 0 < num_chunks <= MIXED_CHUNK_SEQS
            and len(step.input_ids) - d <= self.chunk + self.riding_rows(d)
            and not step.score_rows
            and max(map(len, step.block_tables)) <= self.max_blocks
        )

    def _layout(self, step: StepInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the chunk's tokens go in the bucket's graph.

        The o = c - P tokens past P (0 when c <= P) ride in the padding decode rows [d, d + o):
        the first tokens of the prompts whose pieces start earliest in their prompts (a fresh
        prompt's first tokens read almost no keys as decode rows), so each prompt keeps a
        suffix of its piece in the chunk rows, where the prefill kernel takes the new tokens
        as the last of the context. Returns (rows [c]: graph row of each chunk token, riding
        [chunks]: tokens of each prompt in padding rows, cu [chunks + 1]: the chunk rows'
        offsets of each prompt).
        """
        d = step.num_decode_rows
        bs = smallest_bucket(self.sizes, d)
        flat = np.asarray(step.cu_seqlens_q[d:], dtype=np.int64) - d  # [chunks + 1]
        q_lens = np.diff(flat)
        starts = np.asarray(step.positions, dtype=np.int64)[d + flat[:-1]]
        riding = np.zeros_like(q_lens)
        left = max(0, int(flat[-1]) - self.chunk)
        for j in np.argsort(starts, kind="stable"):
            riding[j] = min(left, q_lens[j])
            left -= riding[j]
        cu = np.concatenate([[0], np.cumsum(q_lens - riding)])
        ride_at = d + np.cumsum(riding) - riding  # first padding row of each prompt
        rows = np.empty(int(flat[-1]), dtype=np.int64)
        for j in range(len(q_lens)):
            a, r = int(flat[j]), int(riding[j])
            rows[a : a + r] = ride_at[j] + np.arange(r)
            rows[a + r : flat[j + 1]] = bs + cu[j] + np.arange(q_lens[j] - r)
        return rows, riding, cu

    def graph_rows(self, step: StepInputs, flat_rows: list[int]) -> list[int]:
        """Flat token indices of the step -> rows of the graph's output: decode rows keep
        theirs; chunk tokens go where _layout puts them."""
        d = step.num_decode_rows
        rows = self._layout(step)[0]
        return [i if i < d else int(rows[i - d]) for i in flat_rows]

    def run(self, step: StepInputs, patch=None) -> torch.Tensor:
        """Replay the bucket's graph; returns hidden states [bs + P, H] (rows as graph_rows maps
        them). patch writes the in-flight step's tokens into the input ids (pending tokens are
        decode rows, which keep their index)."""
        d = step.num_decode_rows
        chunk_rows, riding, cu = self._layout(step)
        head = d + int(riding.sum())  # decode rows, then the riding chunk tokens
        bs = smallest_bucket(self.sizes, d)
        n, k, p = self.sizes[-1], MIXED_CHUNK_SEQS, self.chunk
        rows = bs + p
        host = np.zeros((3, rows), dtype=np.int64)
        host[2] = -1
        for i, values in enumerate((step.input_ids, step.positions, step.slot_mapping)):
            host[i, :d] = values[:d]
            host[i, chunk_rows] = values[d:]
        meta = np.ones(n + 2 * k + 1, dtype=np.int32)
        meta[:d] = step.seq_lens[:d]
        meta[d:head] = host[1, d:head] + 1  # a riding token's context ends at its position
        chunks = len(step.seq_lens) - d
        meta[n : n + chunks] = step.seq_lens[d:]  # a prompt's context is the same either way
        meta[n + k : n + k + chunks + 1] = cu
        meta[n + k + chunks + 1 :] = cu[-1]  # no tokens for the unused chunk rows
        self.tokens[:, :rows].copy_(self.stage(host, torch.int64))
        self.meta.copy_(self.stage(meta, torch.int32))
        tables = pad_block_tables(step.block_tables)  # [d + chunks, w]
        if head > d:  # a riding token reads its prompt's table
            owners = d + np.repeat(np.arange(chunks), riding)
            tables = np.concatenate([tables[:d], tables[owners], tables[d:]])
        tables = self.stage(tables, torch.int32)  # [head + chunks, w]
        width = tables.shape[1]
        self.tables[:head, :width].copy_(tables[:head])
        self.tables[n : n + chunks, :width].copy_(tables[head:])
        if bs > head:
            self.tables[head:bs, :1].zero_()  # padding decode rows: one dummy key in block 0
        if patch is not None:
            patch(self.tokens[0, :rows])
        return self.replays[bs]()
