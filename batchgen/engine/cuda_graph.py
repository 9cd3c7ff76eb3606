"""DecodeGraphs: CUDA graphs of the decode forward over batch-size buckets.

A decode step of a small model is dozens of short kernels per layer; launching them from Python
costs more than running them. Each bucket's forward is captured once over static input
buffers; a step copies its inputs into the buffers (padding up to the bucket) and replays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchgen.engine.step_inputs import StepInputs, pad_block_tables
from batchgen.layers.context import AttentionContext


def bucket_sizes(max_batch: int, step: int = 16) -> list[int]:
    """Captured batch sizes: the powers of two below `step`, then its multiples, and max_batch
    (step 16: 1, 2, 4, 8, 16, 32, 48, ...)."""
    sizes = [1 << i for i in range(step.bit_length()) if 1 << i < min(step, max_batch)]
    sizes += range(step, max_batch, step)
    return sorted(set(sizes + [max_batch]))


def graph_table_width(max_model_len: int, block_size: int) -> int:
    """Columns of a graph's static block table: the blocks of max_model_len tokens, rounded up
    to a multiple of 16 like the eager path's tables, so one kernel variant serves both."""
    return -(-max_model_len // (block_size * 16)) * 16


def smallest_bucket(sizes: list[int], n: int) -> int:
    """The smallest captured size (sizes ascending) that holds n rows."""
    return next(s for s in sizes if s >= n)


def capture_forward(model, args: tuple, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm model(*args) up (Triton compiles outside the capture), then capture it into a CUDA
    graph on `pool` (None: a new one). Returns the graph and its output tensor, which each
    replay overwrites."""
    model(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = model(*args)
    return graph, out


class DecodeGraphs:
    """Captured decode forwards for batches of 1..max_batch sequences.

    Args:
        model: the causal LM (forward(input_ids, positions, ctx) -> hidden [T, H]).
        kv_caches: per-layer (k_cache, v_cache) the graphs read and write.
        max_batch: largest batch captured (max_num_seqs).
        max_model_len: longest context; sizes the static block table and the decode splits.
        block_size: tokens per KV block.
        stage: (values, dtype) -> device tensor without a host sync (the runner's
            PinnedStager.to_device): how each step's inputs reach the static buffers.
        on_bucket: called with each bucket before its graph is warmed up and captured.
    """

    def __init__(
        self,
        model,
        kv_caches,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        stage,
        on_bucket: Callable[[int], None] | None = None,
    ):
        device = kv_caches[0][0].device
        self.sizes = bucket_sizes(max_batch)
        self.max_blocks = graph_table_width(max_model_len, block_size)
        self.max_model_len = max_model_len
        n = max_batch
        # Static inputs, [n] or [n, max_blocks]; a replay reads whatever they hold.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.stage = stage
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(model, kv_caches, on_bucket)

    def _context(self, bs: int, kv_caches) -> AttentionContext:
        return AttentionContext(
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            kv_caches=kv_caches,
            is_decode=True,
        )

    @torch.inference_mode()
    def _capture(self, model, kv_caches, on_bucket=None) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            if on_bucket is not None:
                on_bucket(bs)
            ctx = self._context(bs, kv_caches)
            args = (self.input_ids[:bs], self.positions[:bs], ctx)
            graph, out = capture_forward(model, args, pool)  # out: [bs, H]
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        self.pool = pool  # shared with the mixed-step graphs
        torch.cuda.synchronize()

    def can_run(self, step: StepInputs) -> bool:
        return (
            step.is_decode
            and len(step.seq_lens) <= self.sizes[-1]
            and max(len(t) for t in step.block_tables) <= self.max_blocks
        )

    def run(self, step: StepInputs, patch=None) -> torch.Tensor:
        """Replay the smallest bucket that holds the step; returns hidden states [B, H].

        patch, if given, is called on the static input ids [bs] after they are filled (it
        writes the tokens that are still on the device) and before the replay.
        """
        b = len(step.seq_lens)
        bs = smallest_bucket(self.sizes, b)
        # Rows: input ids, positions, slots, context lengths; padding rows store nothing
        # (slot -1) and attend to one dummy key.
        host = np.zeros((4, bs), dtype=np.int64)
        host[0, :b] = step.input_ids
        host[1, :b] = step.positions
        host[2, :b] = step.slot_mapping
        host[2, b:] = -1
        host[3, :b] = step.seq_lens
        host[3, b:] = 1
        dev = self.stage(host, torch.int64)  # [4, bs]
        self.input_ids[:bs].copy_(dev[0])
        self.positions[:bs].copy_(dev[1])
        self.slot_mapping[:bs].copy_(dev[2])
        self.seq_lens[:bs].copy_(dev[3])
        tables = pad_block_tables(step.block_tables)  # [b, width]
        self.block_tables[:b, : tables.shape[1]].copy_(self.stage(tables, torch.int32))
        if bs > b:
            self.block_tables[b:bs, :1].zero_()
        if patch is not None:
            patch(self.input_ids[:bs])
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:b]
