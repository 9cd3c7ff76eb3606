"""Allocate on a device what a model built on the meta device still lacks: how a model with 4-bit
projections is built without ever allocating their 16-bit weights (build on meta, swap the 4-bit
layers in on the device, then materialize the rest: a 70B model's 16-bit projections would need
140 GB; its 4-bit ones and the rest fit one 80 GB GPU)."""

from __future__ import annotations

import torch
from batchgen.kernels.rotary import build_cos_sin_cache
from torch import nn

from batchgen.models.config import ModelConfig


def materialize_(model: nn.Module, device: torch.device, config: ModelConfig) -> None:
    """Allocate every meta parameter on `device` (a tied one once, shared again) and rebuild
    the buffers the model computes at init there: the rotary embedding's cos/sin table, the
    attention layers' K/V-cache scales (ones)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                data = torch.empty(p.shape, dtype=p.dtype, device=device)
                new[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = new[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if name == "kv_scale":  # an FP8 KV cache's K/V scales: 1.0 until set or calibrated
                module._buffers[name] = torch.ones(b.shape, dtype=b.dtype, device=device)
                continue
            if name != "cos_sin_cache":
                raise RuntimeError(f"cannot rebuild buffer {name!r} of {type(module).__name__}")
            cache = build_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_theta,
                config.rope_scaling,
            )  # fmt: skip
            module._buffers[name] = cache.to(device)
