"""Tensor-parallel layers: the vocab-parallel embedding and the sum of row-parallel projections.

The column-parallel projections (qkv, gate_up, lm_head) need no layer of their own: each rank's
nn.Linear holds its rows (partition.py), and their outputs stay split. The row-parallel ones (o,
down) produce partial sums that `reduce_rows` adds up; the vocab-parallel embedding looks up the
ids in its rows and sums the ranks' rows the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.partition import Partition


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across the ranks (`weight` [V / N, H], the rows
    vocab_start .. vocab_start + V / N of the full table). Each rank looks up the ids it holds,
    writes zeros for the others, and one all-reduce assembles the full rows."""

    def __init__(self, part: Partition, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_start = part.vocab_start
        self.num_local = part.vocab_size
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(part.vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (global ids) -> [T, H], identical on every rank."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)  # [T]
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)


def reduce_rows(
    tp: TensorParallel, partial: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The row-parallel projection's output from each rank's partial product [T, H]: their sum
    (all-reduce), plus the bias, which every rank holds whole and which is added once, after
    the sum. Returns the result (partial itself or a new tensor, see TensorParallel.all_reduce).
    """
    out = tp.all_reduce(partial)
    if bias is not None:
        out.add_(bias)
    return out
