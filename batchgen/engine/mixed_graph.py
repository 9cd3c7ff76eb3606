"""MixedGraphs: CUDA graphs of decode steps that carry one prompt chunk (decode_step_tokens).

With decode_step_tokens = S, a step with d decode rows carries at most one prompt chunk of
S - d tokens or fewer (the scheduler's rule for prompts that are not due). Launched eagerly,
such a step costs the host hundreds of kernel launches and loses what the chunk gains; here
each decode bucket bs < S gets one graph over bs decode rows plus a chunk of
min(S, S - bs + 16) rows (the buckets are at most 16 apart, so that holds any chunk the
scheduler gives a batch in the bucket). Padding rows store nothing (slot -1); padding decode
rows attend to one dummy key; a short chunk is padded at its end, its real tokens attend only
to keys at or before them, and the padding rows' results are never read.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.engine.step_inputs import StepInputs, pad_block_tables
from batchgen.layers.context import AttentionContext

# Bucket sizes are at most this far apart (cuda_graph.bucket_sizes).
_BUCKET_GAP = 16


class MixedGraphs:
    """Captured forwards for d decode rows (bs bucket) + one prompt chunk of <= chunk[bs] tokens.

    Args:
        model: the causal LM (forward(input_ids, positions, ctx) -> hidden [T, H]).
        kv_caches: per-layer (k_cache, v_cache) the graphs read and write.
        decode_sizes: the decode buckets (DecodeGraphs.sizes); those below step_tokens get one.
        step_tokens: decode_step_tokens.
        max_model_len: longest context.
        block_size: tokens per KV block.
        stage: (values, dtype) -> device tensor without a host sync.
        pool: the CUDA graph memory pool to share (the decode graphs'); steps never overlap.
    """

    def __init__(
        self,
        model,
        kv_caches,
        decode_sizes: list[int],
        step_tokens: int,
        max_model_len: int,
        block_size: int,
        stage,
        pool=None,
    ):
        device = kv_caches[0][0].device
        self.sizes = [bs for bs in decode_sizes if bs < step_tokens]
        self.chunk = {bs: min(step_tokens, step_tokens - bs + _BUCKET_GAP) for bs in self.sizes}
        rows = max(bs + self.chunk[bs] for bs in self.sizes)
        max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        # A padded chunk attends up to step_tokens keys past the real context.
        self.max_blocks = -(-(max_model_len + step_tokens) // (block_size * 16)) * 16
        # Static inputs; [3, rows]: input ids, positions, slots.
        self.tokens = torch.zeros(3, rows, dtype=torch.int64, device=device)
        self.tokens[2] = -1
        self.seq_lens = torch.ones(max_bs + 1, dtype=torch.int32, device=device)  # decode | chunk
        self.block_tables = torch.zeros(
            max_bs + 1, self.max_blocks, dtype=torch.int32, device=device
        )  # decode rows | the chunk's sequence
        self.stage = stage
        self.replays: dict = {}  # bucket -> () -> hidden [rows, H]
        self._capture(model, kv_caches, pool)

    def _context(self, bs: int, kv_caches) -> AttentionContext:
        chunk = self.chunk[bs]
        device = self.seq_lens.device
        return AttentionContext(
            cu_seqlens_q=torch.tensor(
                list(range(bs + 1)) + [bs + chunk], dtype=torch.int32, device=device
            ),
            seq_lens=self.seq_lens[:bs],
            max_seqlen_q=chunk,
            max_seqlen_k=self.max_model_len,
            slot_mapping=self.tokens[2, : bs + chunk],
            block_tables=self.block_tables[:bs],
            kv_caches=kv_caches,
            num_decode_rows=bs,
            prefill_cu_seqlens_q=torch.tensor([0, chunk], dtype=torch.int32, device=device),
            prefill_seq_lens=self.seq_lens[-1:],
            prefill_block_tables=self.block_tables[-1:],
        )

    @torch.inference_mode()
    def _capture(self, model, kv_caches, pool) -> None:
        """One graph per bucket on CUDA. On CPU (tests of the layout) each bucket runs the
        model eagerly over the same static buffers instead."""
        cuda = self.tokens.is_cuda
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            rows = bs + self.chunk[bs]
            ctx = self._context(bs, kv_caches)
            args = (self.tokens[0, :rows], self.tokens[1, :rows], ctx)
            if not cuda:
                self.replays[bs] = lambda args=args: model(*args)
                continue
            self.seq_lens[-1] = self.chunk[bs]  # the chunk is a whole prompt while capturing
            model(*args)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(*args)  # [rows, H]
            pool = graph.pool()
            # The graph reads ctx's own small tensors (cu_seqlens): keep them alive with it.
            self.replays[bs] = lambda graph=graph, out=out, args=args: (graph.replay(), out)[1]
        if cuda:
            torch.cuda.synchronize()

    def _bucket(self, d: int) -> int:
        return next(s for s in self.sizes if s >= d)

    def can_run(self, step: StepInputs) -> bool:
        """Decode rows, then exactly one prompt chunk that fits the bucket's graph."""
        d = step.num_decode_rows
        if not 0 < d <= self.sizes[-1] or len(step.seq_lens) != d + 1 or step.score_rows:
            return False
        chunk = len(step.input_ids) - d
        return chunk <= self.chunk[self._bucket(d)] and max(map(len, step.block_tables)) <= (
            self.max_blocks
        )

    def graph_rows(self, step: StepInputs, flat_rows: list[int]) -> list[int]:
        """Flat token indices of the step -> rows of the graph's output (the chunk starts at
        row bs, after the decode rows' padding)."""
        d = step.num_decode_rows
        shift = self._bucket(d) - d
        return [i if i < d else i + shift for i in flat_rows]

    def run(self, step: StepInputs, patch=None) -> torch.Tensor:
        """Replay the bucket's graph; returns hidden states [bs + chunk capacity, H] (rows as
        graph_rows maps them). patch writes the in-flight step's tokens into the input ids."""
        d = step.num_decode_rows
        c = len(step.input_ids) - d
        bs = self._bucket(d)
        rows = bs + self.chunk[bs]
        host = np.zeros((3, rows), dtype=np.int64)
        host[2] = -1
        host[0, :d], host[0, bs : bs + c] = step.input_ids[:d], step.input_ids[d:]
        host[1, :d], host[1, bs : bs + c] = step.positions[:d], step.positions[d:]
        host[2, :d], host[2, bs : bs + c] = step.slot_mapping[:d], step.slot_mapping[d:]
        lens = np.ones(bs + 1, dtype=np.int32)
        lens[:d] = step.seq_lens[:d]
        # The chunk as if full: its real tokens keep their positions (context - c + i).
        lens[bs] = step.seq_lens[d] - c + self.chunk[bs]
        self.tokens[:, :rows].copy_(self.stage(host, torch.int64))
        self.seq_lens[:bs].copy_(self.stage(lens[:bs], torch.int32))
        self.seq_lens[-1:].copy_(self.stage(lens[bs:], torch.int32))
        tables = pad_block_tables(step.block_tables)  # [d + 1, width]
        staged = self.stage(tables, torch.int32)
        width = tables.shape[1]
        self.block_tables[:d, :width].copy_(staged[:d])
        self.block_tables[-1:, :width].copy_(staged[d:])
        if bs > d:
            self.block_tables[d:bs, :1].zero_()
        if patch is not None:
            patch(self.tokens[0, :rows])  # pending tokens are decode rows: same index
        return self.replays[bs]()
