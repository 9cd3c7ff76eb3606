"""Tensor parallel on CPU (gloo, two processes): greedy tokens, seeded samples and LLM.score
equal tensor_parallel_size 1 on the tiny model of every architecture, in fp32.

Each variant starts one two-rank engine (a worker process costs a few seconds) shared by its
tests; the reference is the same model at tensor_parallel_size 1 in this process.
"""

from __future__ import annotations

import random

import pytest

from batchgen import LLM, SamplingParams
from batchgen.models.make_model import make_model

VARIANTS = {
    "llama": ("llama", None),  # norms folded into qkv / gate_up (the default)
    "mistral": ("mistral", None),
    "qwen2-bias": ("qwen2", None),  # q/k/v biases (not folded), tied embeddings
    "qwen3-qknorm": ("qwen3", None),  # q/k RMSNorm, head_dim 32 != hidden / heads, tied
    # One KV head for two ranks (replicated on both), o bias (row-parallel: added once), tied.
    "llama-1kv": (
        "llama",
        {"num_key_value_heads": 1, "attention_bias": True, "tie_word_embeddings": True},
    ),  # fmt: skip
}
# Small chunks and blocks: prompts prefill over several steps, decode rows carry tokens that
# are still on the device (async scheduling), so every path between the ranks runs.
OPTIONS = dict(
    dtype="float32", max_model_len=96, num_kv_blocks=96, block_size=8, max_num_batched_tokens=32
)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(2, 60))] for _ in range(6)]


def params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    return [
        greedy,
        greedy,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=9),
        greedy,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.3),
    ]


@pytest.fixture(scope="module", params=list(VARIANTS))
def engines(request, tmp_path_factory):
    """(tensor_parallel_size 1 LLM, tensor_parallel_size 2 LLM) over one tiny model."""
    arch, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    make_model(path, arch, seed=2, overrides=overrides)
    single = LLM(path, **OPTIONS)
    parallel = LLM(path, tensor_parallel_size=2, **OPTIONS)
    yield single, parallel
    parallel.shutdown()


def test_generate_equals_one_rank(engines, prompts):
    single, parallel = engines
    want = single.generate(prompts, params(), use_tqdm=False)
    got = parallel.generate(prompts, params(), use_tqdm=False)
    assert all(o.error is None for o in got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want):
        if w.logprobs is None:
            continue
        for g_step, w_step in zip(g.logprobs, w.logprobs):
            assert g_step.keys() == w_step.keys()
            assert max(abs(g_step[t] - w_step[t]) for t in w_step) <= 1e-4
    # The reference did generate: the models produce distinct, non-trivial outputs.
    assert len({tuple(o.token_ids) for o in want}) > 1


def test_scores_within_1e4(engines, prompts):
    single, parallel = engines
    candidates = [[p[1:6], p[3:4], [7, 8, 9, 10]] for p in prompts[:4]]
    heads = [p[:20] for p in prompts[:4]]
    want = single.score(heads, candidates, return_token_logprobs=True, use_tqdm=False)
    got = parallel.score(heads, candidates, return_token_logprobs=True, use_tqdm=False)
    for g_row, w_row in zip(got, want):
        for g, w in zip(g_row, w_row):
            assert g.error is None and g.num_tokens == w.num_tokens
            assert abs(g.score - w.score) <= 1e-4
            assert max(abs(a - b) for a, b in zip(g.token_logprobs, w.token_logprobs)) <= 1e-4
            assert g.greedy_match == w.greedy_match
