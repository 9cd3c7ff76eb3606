"""MixedGraphs (decode rows + one prompt chunk in a captured step): the padded layout gives the
same outputs as the eager step. On CPU each bucket runs eagerly over the graphs' static
buffers, so this checks the padding, the pretend-full chunk and the row mapping; the GPU test
replays real graphs."""

from __future__ import annotations

import random

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.cuda_graph import bucket_sizes
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.mixed_graph import MixedGraphs
from batchgen.sampling_params import SamplingParams

STEP_TOKENS = 40


def requests():
    """Greedy and seeded requests; prompts longer than a chunk, outputs of varied length."""
    rng = random.Random(5)
    out = []
    for i in range(24):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 120))]
        if i % 3:
            params = SamplingParams(max_tokens=rng.randrange(4, 110), temperature=0.0)
        else:
            params = SamplingParams(max_tokens=rng.randrange(4, 110), temperature=0.9, seed=i)
        out.append((f"r{i}", prompt, params))
    return out


def run(path: str, graphs: bool):
    config = EngineConfig(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=400,
        max_num_batched_tokens=96,
        decode_step_tokens=STEP_TOKENS,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    used = []
    if graphs:
        mixed = MixedGraphs(
            runner.model,
            runner.kv_caches,
            bucket_sizes(config.max_num_seqs),
            STEP_TOKENS,
            engine.max_model_len,
            config.block_size,
            runner.stager.to_device,
        )
        run_step = mixed.run

        def spy(step, patch=None):
            used.append((step.num_decode_rows, len(step.input_ids) - step.num_decode_rows))
            return run_step(step, patch)

        mixed.run = spy
        runner.mixed_graphs = mixed
    for rid, prompt, params in requests():
        engine.add_request(rid, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = [o.token_ids for o in out.outputs]
    return results, used


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_graph_layout_equals_eager_steps(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    want, _ = run(path, graphs=False)
    got, used = run(path, graphs=True)
    assert got == want
    # Mixed steps ran through the graph layout, with chunks shorter than their capacity and
    # decode counts between buckets (so padding rows on both sides).
    assert len(used) > 10
    assert any(d not in bucket_sizes(256) for d, _ in used)
    assert any(c < STEP_TOKENS - d for d, c in used)
