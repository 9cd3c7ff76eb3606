"""Our fused parameters back in Hugging Face names (for the transformers peer and parity tests)."""

from __future__ import annotations

import torch
from torch import nn


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Un-fuse qkv_proj / gate_up_proj into HF's q/k/v and gate/up tensors (views, no copies)."""
    inverse: dict[str, list[str]] = {}
    for hf_part, (ours, shard) in model.packed_modules.items():
        inverse.setdefault(ours, [None] * len(model.shard_sizes(ours)))[shard] = hf_part
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in inverse if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        for hf_part, piece in zip(inverse[fused], tensor.split(model.shard_sizes(fused), dim=0)):
            out[name.replace(f".{fused}.", f".{hf_part}.")] = piece
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out
