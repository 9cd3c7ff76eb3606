"""Our fused parameters back in Hugging Face names (for the transformers peer and parity tests)."""

from __future__ import annotations

import torch
from torch import nn

# With folded norms (LlamaForCausalLM.fold_norms_), the norm whose weight each fused
# projection holds: fused name -> that layer's norm module name.
_FOLDED_NORMS = {"qkv_proj": "input_layernorm", "gate_up_proj": "post_attention_layernorm"}


def to_hf_state_dict(
    model: nn.Module, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Un-fuse qkv_proj / gate_up_proj into HF's q/k/v and gate/up tensors (views, no copies).

    device: where the tensors go (each is moved before any arithmetic on it, so exporting an
    8B model to the CPU needs no GPU memory beyond the model's); None leaves them in place.

    A model whose norms are folded (the engine folds them) gets the norm weights divided back
    out of those projections, in fp32 then rounded to the weights' dtype (new tensors): exact
    where the norm weights are powers of two (the benchmarks' ones), within a rounding of
    the weights otherwise.
    """
    inverse: dict[str, list[str]] = {}
    for hf_part, (ours, shard) in model.packed_modules.items():
        inverse.setdefault(ours, [None] * len(model.shard_sizes(ours)))[shard] = hf_part
    state = model.state_dict()
    folded = getattr(model, "norms_folded", False)
    out: dict[str, torch.Tensor] = {}
    if device is not None:
        state = {name: tensor.to(device) for name, tensor in state.items()}
    for name, tensor in state.items():
        fused = next((f for f in inverse if f".{f}." in name), None)
        if fused is not None and folded and "weight" in name:
            layer = name.split(f".{fused}.")[0]  # "model.layers.3.self_attn" or "...3.mlp"
            norm = state[f"{layer.rsplit('.', 1)[0]}.{_FOLDED_NORMS[fused]}.weight"]
            tensor = (tensor.float() / norm.float()).to(tensor.dtype)
        if fused is None:
            out[name] = tensor
            continue
        for hf_part, piece in zip(inverse[fused], tensor.split(model.shard_sizes(fused), dim=0)):
            out[name.replace(f".{fused}.", f".{hf_part}.")] = piece
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out
