"""Random-weight 4-bit models of the benchmark presets: every decoder projection's tensors drawn in
the published GPTQ layout (qweight, qzeros, scales, g_idx) directly on the device, then loaded as a
checkpoint's are. The 16-bit projections are never allocated (llama3.1-70b's would need 140 GB)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgen.bench.random_model import init_random_, preset_config
from batchgen.distributed.group import TensorParallel
from batchgen.layers.int4_linear import Int4Linear, PackedInt4, concat_outputs
from batchgen.models.config import ModelConfig
from batchgen.models.int4 import gptq
from batchgen.models.int4.materialize import materialize_
from batchgen.models.int4.plan import projections
from batchgen.models.loader import build_model

# |W| of a random weight ~ 0.02 (the presets' init std): q - 8 spans -8 .. 7 (std ~4.6).
_SCALE_LOW, _SCALE_HIGH = 0.003, 0.006
_V1_SYMMETRIC_ZEROS = 0x77777777  # GPTQ v1 stores zero 8 as 7 in each nibble


def random_gptq(
    n: int, k: int, group: int, act_order: bool, gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """One projection's GPTQ tensors (v1, symmetric): random qweight [K/8, N], qzeros of 7s,
    float16 scales in [0.003, 0.006), g_idx k // group or, with act order, a random order."""
    size = k if group == -1 else group
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device, generator=gen
    )
    groups = k // size
    qzeros = torch.full((groups, -(-n // 8)), _V1_SYMMETRIC_ZEROS, dtype=torch.int32, device=device)
    scales = torch.empty(groups, n, dtype=torch.float16, device=device)
    scales.uniform_(_SCALE_LOW, _SCALE_HIGH, generator=gen)
    g_idx = torch.arange(k, device=device) // size
    if act_order:
        order = torch.randperm(k, device=device, generator=gen)
        g_idx = torch.empty_like(g_idx).scatter_(0, order, g_idx)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.int()}


def build_random_int4_model(
    preset: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    group_size: int = 128,
    act_order: bool = False,
    tp: TensorParallel | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Preset `preset` with 4-bit GPTQ projections (lm_head and embedding 16-bit, random as in
    build_random_model) on `device`; with `tp`, this rank's share (random values of its own).

    Returns:
        (model, the HF config dict it was built from, with the GPTQ quantization_config).
    """
    raw = preset_config(preset)
    config = ModelConfig.from_dict(raw, source=f"preset {preset}")
    model = build_model(config, dtype, torch.device("meta"), tp)
    seed += tp.rank if tp is not None else 0
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for name, linear, hf_names in projections(model):
        if name == "lm_head":
            continue
        sizes = model.shard_sizes(name.rpartition(".")[2]) if len(hf_names) > 1 else None
        parts = []
        for hf, n in zip(hf_names, sizes or [linear.out_features]):
            tensors = random_gptq(n, linear.in_features, group_size, act_order, gen, device)
            parts.append(gptq.to_packed(tensors, group_size, True, hf))
        if act_order and len(parts) > 1:  # fused parts read one input: one order for all
            parts = [parts[0]] + [_with_perm(p, parts[0].perm) for p in parts[1:]]
        layer = Int4Linear(linear.in_features, linear.out_features, linear.bias is not None,
                           device=device, dtype=dtype)  # fmt: skip
        layer.set_packed(concat_outputs(parts, name) if len(parts) > 1 else parts[0])
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
    materialize_(model, device, config)
    init_random_(model, seed)
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
             "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    return model, {**raw, "quantization_config": quant}


@dataclass(frozen=True)
class RandomInt4Preset:
    """The engine's model builder for a random 4-bit preset (picklable: each tensor-parallel
    rank builds its own share on its own GPU)."""

    preset: str
    dtype: torch.dtype
    seed: int = 0
    group_size: int = 128
    act_order: bool = False

    def __call__(self, device: torch.device, tp: TensorParallel | None = None) -> nn.Module:
        return build_random_int4_model(
            self.preset, self.dtype, device, self.seed, self.group_size, self.act_order, tp
        )[0]


def _with_perm(p: PackedInt4, perm: torch.Tensor) -> PackedInt4:
    """p with the act order of its fused neighbour (random weights: any order is as good)."""
    return PackedInt4(p.qweight, p.scales, p.zeros, p.group_size, perm)
