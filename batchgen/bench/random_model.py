"""Random-weight models of the benchmark presets, built directly on the device (no disk)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.layers.int4_linear import Int4Linear
from batchgen.models.config import ModelConfig
from batchgen.models.loader import build_model
from batchgen.models.presets import BENCH_PRESETS, PRESET_NAMES, TINY_PRESETS
from batchgen.models.quantization import load_plan

# The `tiny` / `tiny-moe` presets: tiny shapes with a small vocabulary, for CPU smoke runs.
TINY_VOCAB = 512
_TINY_ARCH = {"tiny": "llama", "tiny-moe": "qwen3_moe"}
_INIT_STD = 0.02  # HF initializer_range: activations stay finite in bf16 over 28-32 layers


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config dict of preset `name` (a copy; callers may change it)."""
    if name in _TINY_ARCH:
        return {**copy.deepcopy(TINY_PRESETS[_TINY_ARCH[name]]), "vocab_size": TINY_VOCAB}
    if name not in BENCH_PRESETS:
        raise ValueError(f"model preset {name!r}: expected one of {', '.join(PRESET_NAMES)}")
    return copy.deepcopy(BENCH_PRESETS[name])


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every weight in place: normal(0, 0.02) for linear/embedding, ones for norms, zero
    biases. A seeded generator on the model's device makes it cheap and reproducible."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights are listed once
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, _INIT_STD, generator=gen)
    return model


def build_random_model(
    preset: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp: TensorParallel | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build preset `preset` on `device` with random weights; with `tp`, only this rank's share
    (its own random values: seed + rank), so no process ever holds the whole model.

    Returns:
        (model, the HF config dict it was built from).
    """
    raw = preset_config(preset)
    model = build_model(ModelConfig.from_dict(raw, source=f"preset {preset}"), dtype, device, tp)
    return init_random_(model, seed + (tp.rank if tp is not None else 0)), raw


@dataclass(frozen=True)
class RandomPreset:
    """The engine's model builder for a random-weight preset (picklable: each tensor-parallel
    rank builds its own share on its own GPU)."""

    preset: str
    dtype: torch.dtype
    seed: int = 0
    quantization: str | None = None  # "fp8": each rank quantizes its share online

    def __call__(self, device: torch.device, tp: TensorParallel | None = None) -> nn.Module:
        model = build_random_model(self.preset, self.dtype, device, self.seed, tp)[0]
        load_plan(model.config, self.quantization, f"preset {self.preset}").finish(model)
        return model


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of all unique parameters (tied embedding / head counted once), 4-bit layers' packed
    weights, scales and zero points included."""
    packed = sum(m.packed_bytes() for m in model.modules() if isinstance(m, Int4Linear))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads of the weights: parameter_bytes less an untied embedding table
    (a step reads one row of it per token)."""
    embed = model.model.embed_tokens.weight
    tied = getattr(model.config, "tie_word_embeddings", False)
    return parameter_bytes(model) - (0 if tied else embed.numel() * embed.element_size())


def non_embedding_params(model: nn.Module) -> int:
    """Parameters excluding the token embedding and the LM head (a 4-bit layer counts its
    in x out weights)."""
    return sum(
        p.numel()
        for n, p in model.named_parameters(remove_duplicate=False)
        if "embed_tokens" not in n and not n.startswith("lm_head")
    ) + sum(
        m.in_features * m.out_features
        for n, m in model.named_modules()
        if isinstance(m, Int4Linear) and not n.startswith("lm_head")
    )
