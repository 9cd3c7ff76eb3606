"""MixedGraphs (decode rows + a prompt chunk of up to MIXED_CHUNK_SEQS prompts in a captured
step): the padded layout gives the same outputs as the eager steps. On CPU each bucket runs
eagerly over the graphs' static buffers, so this checks the padding of both parts, the chunk
tokens riding in padding decode rows, the unused chunk rows, the row mapping and the metadata;
tests/gpu replays real graphs."""

from __future__ import annotations

import random

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.cuda_graph import bucket_sizes, smallest_bucket
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.mixed_graph import (
    MIXED_BUCKET_STEP,
    MixedGraphs,
    mixed_bucket_sizes,
    padding_rows,
)
from batchgen.sampling_params import SamplingParams

CHUNK = 24
# Decode buckets every 8 rows, for the layout's unit tests (their padding counts assume them).
EIGHT_ROW_BUCKETS = [1, 2, 4, 8, *range(16, 256, 8), 256]


def requests():
    """Greedy and seeded requests: prompts shorter and longer than a chunk, varied outputs."""
    rng = random.Random(5)
    out = []
    for i in range(24):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 90))]
        temperature = 0.9 if i % 3 == 0 else 0.0
        params = SamplingParams(max_tokens=rng.randrange(4, 110), temperature=temperature, seed=i)
        out.append((f"r{i}", prompt, params))
    # Prompts short enough to ride whole in a step's padding decode rows, their first token
    # sampled from one of them.
    for i in range(24, 28):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 5))]
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 40), seed=i)))
    return out


def run(path: str, chunk: int, graphs: bool, engines: list | None = None):
    config = EngineConfig(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=400,
        max_num_batched_tokens=96,
        mixed_chunk_tokens=chunk,
    )
    engine = LLMEngine(config)
    if engines is not None:
        engines.append(engine)
    runner = engine.runner
    used = []
    if not graphs:
        # The graphs' schedule, launched eagerly: chunks with their room past P (on CPU no
        # graph exists to give it to the scheduler).
        buckets = mixed_bucket_sizes(config.max_num_seqs)
        engine.scheduler.mixed_chunk_room = lambda d: padding_rows(buckets, d)
    else:
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
            rows = mixed.graph_rows(step, step.sample_rows)
            riding_sampled = any(d <= r < smallest_bucket(mixed.sizes, d) for r in rows)
            used.append((d, len(step.seq_lens) - d, len(step.input_ids) - d, riding_sampled))
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


@pytest.mark.parametrize("step", [8, MIXED_BUCKET_STEP])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_graph_layout_equals_eager_steps(tiny_model_dir, monkeypatch, arch, step):
    from batchgen.engine import mixed_graph

    monkeypatch.setattr(mixed_graph, "MIXED_BUCKET_STEP", step)
    path = tiny_model_dir(arch)
    want, _ = run(path, CHUNK, graphs=False)
    got, used = run(path, CHUNK, graphs=True)
    assert got == want
    # Mixed steps ran through the graph layout: decode counts between buckets (padding decode
    # rows) and chunks of several prompts; with 8-row buckets (up to 7 padding rows to fill),
    # also chunks shorter than P (padding chunk rows).
    assert len(used) > 10
    assert any(d not in mixed_bucket_sizes(256) for d, _, _, _ in used)
    assert any(n > 1 for _, n, _, _ in used)
    assert step != 8 or any(c < CHUNK for _, _, c, _ in used)
    # Chunks past P: tokens rode in the padding decode rows (the scheduler was given the
    # graphs' padding through the runner), within the bucket's padding; some prompts' first
    # tokens were sampled from such a row.
    pad = {d: smallest_bucket(mixed_bucket_sizes(256), d) - d for d in range(1, 257)}
    assert any(c > CHUNK for _, _, c, _ in used)
    assert all(c <= CHUNK + pad[d] and n <= 4 for d, n, c, _ in used)
    assert any(sampled for *_, sampled in used)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_mixed_graph_layout_equals_eager_steps(tiny_model_dir, arch):
    """Mixture-of-experts models through the mixed graphs' padded layout: the same tokens as
    eager steps, and the same experts counted, padding rows (slot -1) routed but not counted."""
    path = tiny_model_dir(arch)
    engines: list = []
    want, _ = run(path, CHUNK, graphs=False, engines=engines)
    got, used = run(path, CHUNK, graphs=True, engines=engines)
    assert got == want
    assert len(used) > 10 and any(d not in mixed_bucket_sizes(256) for d, *_ in used)
    eager, graphs = (e.runner.model.expert_counter.read() for e in engines)
    assert eager == graphs and eager >= engines[0].stats.num_steps


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


def test_no_riding_rows_when_switched_off(monkeypatch):
    """RIDE_PADDING_ROWS = 0 (A/B runs) gives a step no room past P."""
    from batchgen.engine import mixed_graph

    graphs = MixedGraphs.__new__(MixedGraphs)
    graphs.sizes, graphs.chunk = EIGHT_ROW_BUCKETS, 10
    assert graphs.riding_rows(19) == 5
    monkeypatch.setattr(mixed_graph, "RIDE_PADDING_ROWS", 0)
    assert graphs.riding_rows(19) == 0


def test_layout_rides_the_earliest_tokens_in_padding_rows():
    """Chunk tokens past P go to the padding decode rows [d, bs): the first tokens of the
    prompts whose pieces start earliest (each keeps a suffix of its piece in the chunk rows,
    at row bs on); graph_rows follows them, and the chunk rows' cu_seqlens shrink by them."""
    from batchgen.engine.step_inputs import StepInputs

    graphs = MixedGraphs.__new__(MixedGraphs)  # the layout needs only the buckets and P
    graphs.sizes, graphs.chunk = EIGHT_ROW_BUCKETS, 10
    # 19 decode rows (bucket 24: 5 padding rows), then prompt pieces a (positions 40-45),
    # b (0-2, a fresh prompt) and c (7-11).
    d = 19
    positions = [100] * d + list(range(40, 46)) + [0, 1, 2] + list(range(7, 12))
    step = StepInputs(
        positions=positions,
        input_ids=[1] * len(positions),
        cu_seqlens_q=[*range(d + 1), d + 6, d + 9, d + 14],
        seq_lens=[101] * d + [46, 3, 12],
        num_decode_rows=d,
    )
    assert graphs.riding_rows(d) == 5 and graphs.riding_rows(24) == 0
    assert graphs.riding_rows(257) == 0  # past the largest bucket no graph runs
    rows, riding, cu = graphs._layout(step)  # 14 chunk tokens, P = 10: 4 ride
    assert riding.tolist() == [0, 3, 1]  # b whole (starts at 0), then c's first (starts at 7)
    assert cu.tolist() == [0, 6, 6, 10]
    assert rows.tolist() == [24, 25, 26, 27, 28, 29, 19, 20, 21, 22, 30, 31, 32, 33]
    # The last tokens of a, b and c (b's from its riding row).
    assert graphs.graph_rows(step, [0, d + 5, d + 8, d + 13]) == [0, 29, 21, 33]


def test_mixed_graph_buckets_are_multiples_of_the_step():
    """Mixed graphs pad decode rows to 1, 2, 4, 8, 16, then the multiples of MIXED_BUCKET_STEP
    (32: with P = 128 a step's rows are then a multiple of 32 and its padding rows, which carry
    prompt tokens, up to 31); decode graphs every 16 from 16; both end at max_num_seqs."""
    assert MIXED_BUCKET_STEP == 32
    assert bucket_sizes(256) == [1, 2, 4, 8, *range(16, 256, 16), 256]
    assert mixed_bucket_sizes(256) == [1, 2, 4, 8, 16, *range(32, 256, 32), 256]
    assert mixed_bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert mixed_bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert mixed_bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert mixed_bucket_sizes(1) == [1]
    assert all(padding_rows(mixed_bucket_sizes(256), d) < 32 for d in range(1, 257))
