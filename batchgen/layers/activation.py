"""SiLU-and-mul: the gated activation of Llama-family MLPs over a fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] (gate first, then up) -> [T, I]."""
        return ops.silu_and_mul(gate_up)
