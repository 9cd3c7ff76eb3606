"""K/V-cache scales stored in a checkpoint (compressed-tensors `kv_cache_scheme`): taken out of the
tensor stream and set on the model's attention layers."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from batchgen.models.errors import ModelLoadError

# model.layers.N.self_attn.k_scale (compressed-tensors, vLLM) or the older
# model.layers.N.self_attn.k_proj.output_scale (AutoFP8, early llm-compressor).
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def kv_scale_slot(name: str) -> tuple[int, int] | None:
    """(layer, 0 for K / 1 for V) of a checkpoint K/V-scale tensor name, else None."""
    m = _NAME.search(name)
    if m is None:
        return None
    return int(m.group(1)), 0 if (m.group(2) or m.group(3)) == "k" else 1


class CheckpointKVScales:
    """Collects the K/V scales of a tensor stream (`take`) and sets them on the model (`apply`)."""

    def __init__(self) -> None:
        self.scales: dict[tuple[int, int], float] = {}

    def take(self, tensors) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Pass (file, name, tensor) through, keeping K/V-scale tensors back."""
        for file, name, tensor in tensors:
            slot = kv_scale_slot(name)
            if slot is None:
                yield file, name, tensor
                continue
            if tensor.numel() != 1:
                raise ModelLoadError(
                    f"{file}: {name} has shape {tuple(tensor.shape)}; a K/V-cache scale is one "
                    "number per layer (per-head or per-channel KV scales are not supported)"
                )
            value = float(tensor.float().item())
            if not 0 < value < math.inf:
                raise ModelLoadError(
                    f"{file}: {name} = {value}: a scale must be a finite number > 0"
                )
            self.scales[slot] = value

    def apply(self, model: nn.Module) -> None:
        """Set each layer's kv_scale buffer from the collected scales (a layer needs both)."""
        if not self.scales:
            return
        layers = {m.layer_idx: m for m in model.modules() if hasattr(m, "kv_scale")}
        for layer, attn in layers.items():
            k, v = self.scales.get((layer, 0)), self.scales.get((layer, 1))
            if k is None or v is None:
                raise ModelLoadError(
                    f"the checkpoint has K/V-cache scales for some layers but lacks layer "
                    f"{layer}'s {'k_scale' if k is None else 'v_scale'}"
                )
            attn.kv_scale.copy_(torch.tensor([k, v], dtype=torch.float32))
        extra = sorted({layer for layer, _ in self.scales} - set(layers))
        if extra:
            raise ModelLoadError(
                f"the checkpoint has K/V-cache scales for layers {extra} the model does not have"
            )
