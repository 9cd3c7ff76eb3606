"""Rotary position embedding (neox / Hugging Face rotate-half style) with a cached cos/sin table."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen.kernels import ops
from batchgen.kernels.rotary import build_cos_sin_cache


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        # [max_position, head_dim] float32: cos in the first half of the columns, sin in the second.
        cache = build_cos_sin_cache(head_dim, max_position, base, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hk, D] -> rotated (q, k)."""
        return ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
