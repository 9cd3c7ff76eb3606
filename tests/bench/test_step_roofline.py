"""The per-step roofline at a KV capacity, against steps worked out by hand."""

from __future__ import annotations

import pytest

from batchgen.bench.roofline import ModelShape
from batchgen.bench.step_roofline import step_roofline
from batchgen.bench.workloads import Workload

SHAPE = ModelShape(num_layers=2, num_heads=4, head_dim=8, non_embedding_params=1000,
                   weight_bytes=5000, kv_bytes_per_token=64)  # fmt: skip
ATTN = 4 * 2 * 4 * 8  # attention FLOPs per position


def workload(prompts: list[int], outputs: list[int]) -> Workload:
    return Workload("t", [[1] * p for p in prompts], outputs, shared_prefix_lens=[0] * len(prompts))


def test_one_request_step_by_step():
    # Prompt 10, 3 tokens: the prompt step, then positions 10 and 11 decode.
    weights, bw, peak = 4000, 1e3, 1e6
    got = step_roofline(SHAPE, workload([10], [3]), weights, 1024, 16, peak, bw)
    prompt_flops = SHAPE.forward_flops(0, 10)
    steps = [
        (weights, prompt_flops),
        (weights + 64 * 11, 2000 + ATTN * 10),
        (weights + 64 * 12, 2000 + ATTN * 11),
    ]
    assert got.steps == 3
    assert got.seconds == pytest.approx(sum(max(b / bw, f / peak) for b, f in steps))
    assert got.bytes == pytest.approx(sum(b for b, _ in steps))
    assert got.flops == pytest.approx(sum(f for _, f in steps))
    assert got.mean_batch == pytest.approx(2 / 3)


def test_capacity_serializes_requests():
    # Each request needs 2 of the 3 blocks: the second waits for the first to finish.
    w = workload([20, 20], [4, 4])
    wide = step_roofline(SHAPE, w, 4000, 10_000, 16, 1e12, 1e3)
    narrow = step_roofline(SHAPE, w, 4000, 48, 16, 1e12, 1e3)
    assert wide.steps == 4  # both admitted at once: prompt step + 3 decode steps
    assert narrow.steps == 8
    assert narrow.seconds > wide.seconds
    assert narrow.mean_batch == pytest.approx(6 / 8)


def test_compute_bound_steps_are_counted():
    # A huge prompt on a slow matmul: its step is FLOPs-bound.
    got = step_roofline(SHAPE, workload([4000], [2]), 10, 1 << 20, 16, 1e3, 1e12)
    assert got.flops_bound_share > 0.99
    assert got.seconds == pytest.approx((SHAPE.forward_flops(0, 4000) + 2000 + ATTN * 4000) / 1e3)


def test_request_that_never_fits_and_score_workloads():
    assert step_roofline(SHAPE, workload([100], [100]), 10, 64, 16, 1e9, 1e9) is None
    score = Workload("score", [[1, 2]], [], candidates=[[[3]]], shared_prefix_lens=[0])
    assert step_roofline(SHAPE, score, 10, 1024, 16, 1e9, 1e9) is None
