"""Tensor parallel on CPU (gloo, two processes): greedy tokens, seeded samples and LLM.score
equal tensor_parallel_size 1 on the tiny model of every architecture, in fp32.

Each variant starts one two-rank engine (a worker process costs a few seconds) shared by its
tests; the reference is the same model at tensor_parallel_size 1 in this process.
"""

from __future__ import annotations

import pytest
from tp_compare import assert_same_generations, assert_same_scores, mixed_params, random_prompts

from batchgen import LLM
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
    return random_prompts()


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
    want = single.generate(prompts, mixed_params(MAX_TOKENS, 3), use_tqdm=False)
    got = parallel.generate(prompts, mixed_params(MAX_TOKENS, 3), use_tqdm=False)
    assert_same_generations(got, want)


def test_scores_within_1e4(engines, prompts):
    assert_same_scores(*engines, prompts)
