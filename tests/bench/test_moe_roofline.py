"""The mixture-of-experts roofline: shapes of the presets, the all-resident expected expert reads
and the roofline over the steps a run took, against direct sums."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.moe_roofline import (
    ExpertShape,
    dense_bytes,
    expert_shape,
    kv_bytes,
    moe_model_shape,
    resident_cost,
    steps_taken_metrics,
)
from batchgen.bench.random_model import non_embedding_params, parameter_bytes, preset_config
from batchgen.bench.roofline import ModelShape, model_shape
from batchgen.bench.workloads import Workload
from batchgen.models.config import ModelConfig
from batchgen.models.loader import build_model


def test_qwen3_30b_a3b_preset_shape():
    mc = ModelConfig.from_dict(preset_config("qwen3-30b-a3b"))
    model = build_model(mc, torch.bfloat16, torch.device("meta"))  # shapes only
    shape = model_shape(mc, non_embedding_params(model), parameter_bytes(model), 2)
    experts = expert_shape(mc, 2)
    assert experts == ExpertShape(48, 128, 8, 3 * 768 * 2048, 2 * 3 * 768 * 2048)
    assert shape.weight_bytes == pytest.approx(61.1e9, rel=0.01)  # "61 GB of weights"
    active = moe_model_shape(shape, experts).non_embedding_params
    assert active == pytest.approx(2.73e9, rel=0.01)  # 3.3B with the embedding and head
    assert dense_bytes(shape, experts) == pytest.approx(2 * (48 * 19.2e6 + 2 * 311e6), rel=0.01)
    assert shape.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_mixtral_preset_shape():
    mc = ModelConfig.from_dict(preset_config("mixtral-8x7b"))
    model = build_model(mc, torch.bfloat16, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(46.7e9, rel=0.01)
    experts = expert_shape(mc, 2)
    shape = model_shape(mc, non_embedding_params(model), parameter_bytes(model), 2)
    assert moe_model_shape(shape, experts).non_embedding_params == pytest.approx(12.6e9, rel=0.01)


def test_expected_experts_under_uniform_routing():
    e = ExpertShape(2, 8, 2, 10, 20)
    assert e.expected_experts(1) == pytest.approx(2)
    assert e.expected_experts(2) == pytest.approx(8 * (1 - 0.75**2))
    assert e.expected_experts(1000) == pytest.approx(8)


def test_resident_cost_is_the_direct_sum():
    shape = ModelShape(
        4, 2, 8, non_embedding_params=5000, weight_bytes=10_000, kv_bytes_per_token=6
    )
    e = ExpertShape(2, 8, 2, expert_params=100, expert_bytes=200)  # experts: 3,200 bytes
    w = Workload("t", [[1] * 10, [2] * 5, [3] * 7], [3, 1, 2])
    cost = resident_cost(shape, e, w)
    # Step 1 runs 3 sequences, step 2 two, step 3 one; each reads 6,800 dense bytes and
    # 2 layers x 200 bytes x the experts n tokens are expected to reach.
    weights = sum(6_800 + 400 * e.expected_experts(n) for n in (3, 2, 1))
    kv = 6 * ((10 + 11 + 12) + 5 + (7 + 8))
    assert cost.decode_bytes == pytest.approx(weights + kv)
    assert kv_bytes(shape, w) == kv
    # FLOPs of the active parameters: 2 layers x 6 idle experts x 100 fewer.
    attention = 4 * 4 * 2 * 8 * (45 + 10 + 21)  # positions 0..9, 0..4, 0..6
    assert cost.prefill_flops == pytest.approx(2 * (5000 - 1200) * 22 + attention)


def test_steps_taken_is_the_direct_sum():
    shape = ModelShape(4, 2, 8, 1000, 10_000, 6)
    e = ExpertShape(2, 8, 2, 100, 200)
    w = Workload("t", [[1] * 10], [3])
    m = steps_taken_metrics(shape, e, w, steps=5, experts_touched=17, wall_s=2.0,
                            output_tokens=3, copy_bytes_per_s=1e4)  # fmt: skip
    ideal = (5 * 6_800 + 17 * 200 + 6 * 33) / 1e4
    assert m["ideal_steps_taken_s"] == pytest.approx(ideal)
    assert m["roofline_fraction_steps_taken"] == pytest.approx(ideal / 2.0)
    assert m["experts_touched_per_layer_step"] == pytest.approx(17 / 10)
