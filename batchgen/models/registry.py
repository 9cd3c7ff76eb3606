"""Registry: the `architectures` string of config.json -> the model class that runs it."""

from __future__ import annotations

import importlib

from batchgen.models.errors import ModelLoadError

# Imported lazily so listing architectures never pulls in torch.
_REGISTRY = {
    "LlamaForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "batchgen.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "batchgen.models.moe_decoder:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "batchgen.models.moe_decoder:MixtralForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type:
    if architecture not in _REGISTRY:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        )
    module, name = _REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module), name)
