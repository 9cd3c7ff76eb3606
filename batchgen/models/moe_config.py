"""MoeConfig: the mixture-of-experts hyper-parameters of a Qwen3-MoE or Mixtral config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.models.errors import ModelLoadError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


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
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    round_weights: bool
    sparse_layers: tuple[bool, ...]

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def moe_config(raw: dict[str, Any], arch: str, num_layers: int, source: str) -> MoeConfig | None:
    """The MoeConfig of a config.json dict, None for dense architectures.

    Qwen3-MoE layer i is sparse when i is not in mlp_only_layers and (i + 1) is a multiple of
    decoder_sparse_step, as transformers' Qwen3MoeDecoderLayer decides.

    Raises:
        ModelLoadError: a missing or out-of-range key, named with `source`.
    """
    if arch not in MOE_ARCHITECTURES:
        return None

    def need(*keys: str) -> Any:
        for key in keys:
            if raw.get(key) is not None:
                return raw[key]
        raise ModelLoadError(f"{source}: missing required key {keys[0]!r} for {arch}")

    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (an attribute alias).
    num_experts = int(need("num_experts", "num_local_experts"))
    top_k = int(need("num_experts_per_tok"))
    if arch == "MixtralForCausalLM":
        inter = int(need("intermediate_size"))
        sparse = (True,) * num_layers
        norm, round_weights = True, False
    else:
        inter = int(need("moe_intermediate_size"))
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelLoadError(f"{source}: mlp_only_layers must be a list of layer indices")
        sparse = tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
        norm, round_weights = bool(raw.get("norm_topk_prob", False)), True
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts"
        )
    if inter <= 0:
        raise ModelLoadError(f"{source}: the experts' intermediate size must be positive")
    return MoeConfig(num_experts, top_k, inter, norm, round_weights, sparse)
