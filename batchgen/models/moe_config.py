"""MoeConfig: the mixture-of-experts hyper-parameters of a Qwen3-MoE or Mixtral config.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.models.errors import ModelLoadError

# Each architecture's checkpoint names: the sparse block, and each expert's gate, up and down
# projections (Mixtral's w1 is the gate, w3 the up projection).
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}
MOE_ARCHITECTURES = tuple(CHECKPOINT_NAMES)
# The config.json key of each expert's intermediate size (Mixtral has no dense layers).
_INTERMEDIATE_KEY = {
    "Qwen3MoeForCausalLM": "moe_intermediate_size",
    "MixtralForCausalLM": "intermediate_size",
}


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of a decoder whose MLP is (in some or all layers) a sparse MoE block.

    Attributes:
        num_experts: E, the experts of each sparse layer.
        top_k: experts each token is sent to.
        intermediate_size: I, each expert's gate/up width (the dense layers use the model's
            intermediate_size).
        norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1 (Mixtral
            always; Qwen3-MoE per its config).
        round_weights: the routing weights are rounded to the model's dtype before they scale
            the experts' outputs (Qwen3-MoE); Mixtral scales in float32.
        sparse_layers: per decoder layer, True where the MLP is the MoE block.
        intermediate_key: the config.json key intermediate_size comes from (for messages).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    round_weights: bool
    sparse_layers: tuple[bool, ...]
    intermediate_key: str = "moe_intermediate_size"

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def moe_config(
    raw: dict[str, Any], arch: str, num_layers: int, source: str, size: Callable[..., int]
) -> MoeConfig | None:
    """The MoeConfig of a config.json dict, None for dense architectures.

    Qwen3-MoE layer i is sparse when i is not in mlp_only_layers and (i + 1) is a multiple of
    decoder_sparse_step, as transformers' Qwen3MoeDecoderLayer decides.

    Args:
        size: size(key, default=None) -> raw[key] as a bounded positive int (config.py's
            check), ModelLoadError naming source and key otherwise.

    Raises:
        ModelLoadError: a missing or out-of-range key, named with `source`.
    """
    if arch not in MOE_ARCHITECTURES:
        return None
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (an attribute alias).
    experts_key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    num_experts = size(experts_key)
    top_k = size("num_experts_per_tok")
    key = _INTERMEDIATE_KEY[arch]
    inter = size(key)
    if arch == "MixtralForCausalLM":
        sparse = (True,) * num_layers
        norm, round_weights = True, False
    else:
        step = size("decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelLoadError(f"{source}: mlp_only_layers must be a list of layer indices")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        norm, round_weights = bool(raw.get("norm_topk_prob", False)), True
    if top_k > num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={top_k} must be at most the {num_experts} experts"
        )
    return MoeConfig(num_experts, top_k, inter, norm, round_weights, sparse, key)


def expert_tensor_shapes(
    arch: str, layer: int, hidden: int, moe: MoeConfig
) -> dict[str, tuple[tuple[int, ...], str]]:
    """{checkpoint tensor name: (shape, the config keys that size it)} of sparse layer `layer`:
    its router and every expert's gate, up and down projections, under the Hub's names."""
    block, (gate, up, down) = CHECKPOINT_NAMES[arch]
    p = f"model.layers.{layer}.{block}."
    e, i = moe.num_experts, moe.intermediate_size
    inter = moe.intermediate_key
    out = {p + "gate.weight": ((e, hidden), "num_experts, hidden_size")}
    for x in range(e):
        out[f"{p}experts.{x}.{gate}.weight"] = ((i, hidden), f"{inter}, hidden_size")
        out[f"{p}experts.{x}.{up}.weight"] = ((i, hidden), f"{inter}, hidden_size")
        out[f"{p}experts.{x}.{down}.weight"] = ((hidden, i), f"hidden_size, {inter}")
    return out
