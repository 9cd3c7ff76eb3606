"""Random 4-bit GPTQ presets: built without 16-bit projections, counted as the 16-bit model's
parameters, their weights at the presets' scale."""

from __future__ import annotations

import torch
from batchgen.kernels.int4_gemm import dequantize_int4_ref

from batchgen.bench.random_int4 import build_random_int4_model, random_gptq
from batchgen.bench.random_model import (
    build_random_model,
    decode_weight_bytes,
    non_embedding_params,
    parameter_bytes,
)
from batchgen.layers.int4_linear import Int4Linear
from batchgen.models.int4 import gptq

CPU = torch.device("cpu")


def test_counts_match_the_16_bit_model():
    dense, _ = build_random_model("tiny", torch.float32, CPU)
    int4, raw = build_random_int4_model("tiny", torch.float32, CPU, group_size=-1)
    assert raw["quantization_config"]["quant_method"] == "gptq"
    assert non_embedding_params(int4) == non_embedding_params(dense)
    layers = [m for m in int4.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * int4.config.num_hidden_layers
    projections = sum(m.in_features * m.out_features for m in layers)
    # Packed: half a byte a weight plus one fp16 scale per output channel (symmetric: the zero
    # points, all 8, are not stored).
    packed = projections // 2 + sum(2 * m.out_features for m in layers)
    assert parameter_bytes(dense) - parameter_bytes(int4) == 4 * projections - packed
    embed = int4.model.embed_tokens.weight
    assert decode_weight_bytes(int4) == parameter_bytes(int4) - embed.numel() * 4


def test_weights_are_at_the_presets_scale():
    model, _ = build_random_int4_model("tiny", torch.float32, CPU, group_size=-1, act_order=True)
    qkv = model.model.layers[0].self_attn.qkv_proj
    w = dequantize_int4_ref(qkv.weight, qkv.scales, qkv.zeros, qkv.group_size)
    assert 0.01 < w.std().item() < 0.04  # the 16-bit presets' init std is 0.02
    assert qkv.zeros is None  # symmetric (v1 stores 7, read as 8): no zero points kept
    assert qkv.perm is None  # one group per channel: an act order changes nothing
    x = torch.randn(3, 64)
    assert torch.isfinite(model.lm_head(qkv(x)[:, :64])).all()


def test_random_act_order_fills_every_group():
    gen = torch.Generator().manual_seed(0)
    tensors = random_gptq(48, 256, 64, True, gen, CPU)
    assert not torch.equal(tensors["g_idx"].long(), torch.arange(256) // 64)
    assert torch.bincount(tensors["g_idx"].long()).tolist() == [64] * 4
    p = gptq.to_packed(tensors, 64, True, "x")
    assert p.perm is not None and torch.equal(
        tensors["g_idx"][p.perm].long(), torch.arange(256) // 64
    )
