"""LoadPlan: the steps the loader runs around loading the weights, chosen from the checkpoint's
quantization_config and the `quantization` option."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from batchgen.models.config import ModelConfig
from batchgen.models.quantization.kv_scales import CheckpointKVScales


class LoadPlan:
    """Unquantized weights: only K/V-cache scales are taken from the stream and set."""

    def __init__(self) -> None:
        self.kv_scales = CheckpointKVScales()

    def prepare(self, model: nn.Module) -> None:
        """Change the freshly built model before its weights load."""

    def tensors(self, stream) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The checkpoint's (file, name, tensor) triples as the model's parameters take them."""
        return self.kv_scales.take(stream)

    def finish(self, model: nn.Module) -> None:
        """After every weight is loaded."""
        self.kv_scales.apply(model)


def load_plan(config: ModelConfig, quantization: str | None = None) -> LoadPlan:
    """The plan for `config`'s checkpoint and the `quantization` option."""
    return LoadPlan()
