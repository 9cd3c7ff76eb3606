"""MixedGraphs (decode rows + a prompt chunk of up to MIXED_CHUNK_SEQS prompts in a captured
step): the padded layout gives the same outputs as the eager steps. On CPU each bucket runs
eagerly over the graphs' static buffers, so this checks the padding of both parts, the unused
chunk rows, the row mapping and the metadata; tests/gpu replays real graphs."""

from __future__ import annotations

import random

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.cuda_graph import bucket_sizes
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.mixed_graph import MixedGraphs, mixed_bucket_sizes
from batchgen.sampling_params import SamplingParams

CHUNK = 24


def requests():
    """Greedy and seeded requests: prompts shorter and longer than a chunk, varied outputs."""
    rng = random.Random(5)
    out = []
    for i in range(24):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 90))]
        temperature = 0.9 if i % 3 == 0 else 0.0
        params = SamplingParams(max_tokens=rng.randrange(4, 110), temperature=temperature, seed=i)
        out.append((f"r{i}", prompt, params))
    return out


def run(path: str, chunk: int, graphs: bool):
    config = EngineConfig(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=400,
        max_num_batched_tokens=96,
        mixed_chunk_tokens=chunk,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    used = []
    if graphs:
        mixed = MixedGraphs(
            runner.model,
            runner.kv_caches,
            mixed_bucket_sizes(config.max_num_seqs),
            chunk,
            engine.max_model_len,
            config.block_size,
            runner.stager.to_device,
        )
        run_step = mixed.run

        def spy(step, patch=None):
            d = step.num_decode_rows
            used.append((d, len(step.seq_lens) - d, len(step.input_ids) - d))
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
    want, _ = run(path, CHUNK, graphs=False)
    got, used = run(path, CHUNK, graphs=True)
    assert got == want
    # Mixed steps ran through the graph layout: decode counts between buckets (padding decode
    # rows), chunks of several prompts, and chunks shorter than P (padding chunk rows).
    assert len(used) > 10
    assert any(d not in mixed_bucket_sizes(256) for d, _, _ in used)
    assert any(n > 1 for _, n, _ in used)
    assert any(c < CHUNK for _, _, c in used)
    assert all(c <= CHUNK and n <= 4 for _, n, c in used)


def test_mixed_chunks_equal_plain_scheduling(tiny_model_dir):
    """Prompts riding in decode steps (another order, other batches) give each request the
    same greedy tokens as the default schedule."""
    path = tiny_model_dir("llama")
    plain, _ = run(path, 0, graphs=False)
    mixed, _ = run(path, CHUNK, graphs=False)
    greedy = [rid for rid, _, params in requests() if params.temperature == 0.0]
    assert {r: mixed[r] for r in greedy} == {r: plain[r] for r in greedy}


def test_auto_chunk_tokens_by_model_size(tiny_model_dir):
    """None (auto) turns mixed chunks on for models of 4B parameters or more only, within the
    step budget; an explicit value is kept."""
    from batchgen.engine.prompt_allowance import auto_chunk_tokens

    assert auto_chunk_tokens(600_000_000, 16384) == 0
    assert auto_chunk_tokens(8_000_000_000, 16384) == 128
    assert auto_chunk_tokens(8_000_000_000, 64) == 64
    path = tiny_model_dir("llama")
    common = dict(model=path, dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert LLMEngine(EngineConfig(**common)).scheduler.mixed_chunk_tokens == 0
    engine = LLMEngine(EngineConfig(mixed_chunk_tokens=24, **common))
    assert engine.runner.mixed_chunk_tokens == engine.scheduler.mixed_chunk_tokens == 24


def test_mixed_graphs_bucket_decode_rows_finer():
    """Mixed graphs pad decode rows to every 8 (their projections run at or past the ridge,
    where a padded row costs compute); decode graphs to every 16; both end at max_num_seqs."""
    assert bucket_sizes(256) == [1, 2, 4, 8, *range(16, 256, 16), 256]
    assert mixed_bucket_sizes(256) == [1, 2, 4, 8, *range(16, 256, 8), 256]
    assert mixed_bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert set(bucket_sizes(256)) <= set(mixed_bucket_sizes(256))
