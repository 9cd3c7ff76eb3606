"""LoadPlan: the steps the loader runs around loading the weights (the base: plain weights, K/V
scales taken from the stream)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from batchgen.models.quantization.kv_scales import CheckpointKVScales


class LoadPlan:
    """Unquantized weights: only K/V-cache scales are taken from the stream and set."""

    def __init__(self) -> None:
        self.kv_scales = CheckpointKVScales()

    def build_device(self, device: torch.device) -> torch.device:
        """Where the loader builds the model (a plan that swaps layers before any weight is
        allocated builds on meta and allocates the rest in prepare)."""
        return device

    def prepare(self, model: nn.Module) -> None:
        """Change the freshly built model before its weights load."""

    def tp_select(self, select):
        """The tensor-parallel slice function of iter_tensors for this checkpoint, given the
        model's own (model.tp_slice: its weights' rows or columns)."""
        return select

    def tensors(self, stream) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's (file, name, tensor) triples as the model's parameters take them."""
        return self.kv_scales.take(stream)

    def finish(self, model: nn.Module) -> None:
        """After every weight is loaded."""
        self.kv_scales.apply(model)
