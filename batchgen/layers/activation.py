"""SiLU-and-mul: the gated activation of Llama-family MLPs over a fused gate_up projection."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.kernels import ops


class SiluAndMul(nn.Module):
    def forward(
        self, gate_up: torch.Tensor, rms_rows: torch.Tensor | None = None, rms_eps: float = 1e-6
    ) -> torch.Tensor:
        """gate_up: [T, 2I] (gate first, then up) -> [T, I]; rms_rows [T, H]: scale each row by
        1 / RMS of that hidden row first (a norm folded into gate_up)."""
        return ops.silu_and_mul(gate_up, rms_rows, rms_eps)
