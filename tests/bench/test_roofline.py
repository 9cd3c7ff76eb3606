"""The roofline models: the benchmark spec's nano limits and the FLOPs sums."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.random_model import non_embedding_params, parameter_bytes, preset_config
from batchgen.bench.roofline import ModelShape, model_shape, roofline_metrics, workload_cost
from batchgen.bench.workloads import Workload, nano
from batchgen.models.config import ModelConfig
from batchgen.models.loader import build_model


def _shape(preset: str, kv_itemsize: int = 2) -> ModelShape:
    mc = ModelConfig.from_dict(preset_config(preset))
    model = build_model(mc, torch.bfloat16, torch.device("meta"))  # shapes only, no memory
    return model_shape(mc, non_embedding_params(model), parameter_bytes(model), kv_itemsize)


@pytest.mark.parametrize(("preset", "limit"), [("qwen3-0.6b", 26_600), ("llama3.1-8b", 12_400)])
def test_nano_decode_limit_matches_benchmarks_md(preset, limit):
    w = nano()
    m = roofline_metrics(workload_cost(_shape(preset), w), 10.0, w.num_output_tokens, 775e12, 3e12)
    assert m["roofline_output_tok_s"] == pytest.approx(limit, rel=0.01)


def test_fp8_kv_halves_the_kv_bytes_of_the_decode_model():
    w = nano()
    bf16, fp8 = (workload_cost(_shape("qwen3-0.6b", n), w) for n in (2, 1))
    weights = bf16.decode_steps * _shape("qwen3-0.6b").weight_bytes
    assert fp8.decode_bytes - weights == pytest.approx((bf16.decode_bytes - weights) / 2)
    assert fp8.decode_flops == bf16.decode_flops  # FLOPs do not depend on the KV dtype


def test_flops_model_matches_a_direct_sum():
    shape = ModelShape(2, 4, 8, 1000, 4000, 64)
    direct = sum(2 * 1000 + 4 * 2 * 4 * 8 * pos for pos in range(5, 12))
    assert shape.forward_flops(5, 7) == pytest.approx(direct)
    w = Workload("t", [[1] * 10, [2] * 6], [3, 1], shared_prefix_lens=[0, 4])
    cost = workload_cost(shape, w)
    assert cost.prefill_flops == pytest.approx(
        shape.forward_flops(0, 10) + shape.forward_flops(4, 2)
    )
    assert cost.decode_flops == pytest.approx(shape.forward_flops(10, 2))
    assert cost.decode_steps == 3
    # steps x weights + KV of contexts 10, 11, 12 (first) and 6 (second)
    assert cost.decode_bytes == pytest.approx(3 * 4000 + 64 * (10 + 11 + 12 + 6))
