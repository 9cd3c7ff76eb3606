"""LLM.generate on CPU equals transformers' greedy generate, whatever the engine does inside."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.request_checks import ModelLimits, check_request

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompts():
    """32 token-id prompts of varied lengths (3..150), BOS first."""
    rng = random.Random(7)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(2, 150))] for _ in range(32)]


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    """transformers' greedy generate on each prompt alone."""
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
            refs.append(out[0, len(p) :].tolist())
    return refs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize(
    "options",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 7, "block_size": 8},  # chunked prefill forced
        {"max_num_seqs": 3},
    ],
    ids=["prefix-cache-on", "prefix-cache-off", "chunked-prefill", "few-seqs"],
)
def test_greedy_equals_transformers(model_path, prompts, reference, options):
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512, **options)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.error is None for o in outs)


def test_greedy_equals_transformers_under_preemption(model_path, prompts, reference):
    # 40 blocks of 8 tokens: a few sequences at a time; the rest are preempted and recomputed.
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=40, block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_shared_prefix_is_cached_and_outputs_unchanged(model_path):
    rng = random.Random(3)
    prefix = [0] + [rng.randrange(5, 500) for _ in range(100)]
    prompts = [
        prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 20))] for _ in range(8)
    ]
    cached = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=256)
    # Admit one at a time so later prompts find the first one's blocks.
    outs_cached = [cached.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    plain = LLM(
        model_path,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    outs_plain = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs_cached) >= 7 * 96  # 6 full blocks of 16 each
    assert cached.stats.num_cached_tokens > 0 and cached.stats.prefix_cache_hit_rate > 0.5
    assert plain.stats.num_cached_tokens == 0
    assert [o.token_ids for o in outs_cached] == [o.token_ids for o in outs_plain]


def test_seeded_sampling_independent_of_batch_and_order(model_path, prompts):
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512)
    target = prompts[5]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate([target], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(16)]
    batch = prompts[10:26]
    in_batch = llm.generate(batch + [target], others + [params], use_tqdm=False)[-1].token_ids
    reversed_out = llm.generate([target] + batch[::-1], [params] + others[::-1], use_tqdm=False)
    assert alone == in_batch == reversed_out[0].token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].token_ids != alone


def test_n_samples_share_prompt_blocks_and_differ(model_path):
    block_size = 16
    prompt = [0] + list(range(10, 10 + 70))  # 71 tokens: 4 full blocks + 7 tokens
    llm = LLM(
        model_path, dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=block_size
    )
    engine = llm.engine
    engine.add_request(
        "r", prompt, SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    )
    used_after_fork = None
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        running = engine.scheduler.running
        if used_after_fork is None and len(running) == 4:
            used_after_fork = engine.block_manager.num_used_blocks
    # Sample 0 holds ceil(71/16) = 5 blocks; each sibling shares its 4 full prompt blocks
    # and owns one block for the partial prompt block plus what it generated so far (< 1 block).
    assert used_after_fork == 5 + 3 * 1
    (out,) = outs
    texts = [tuple(o.token_ids) for o in out.outputs]
    assert len(texts) == 4 and len(set(texts)) == 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(t) == 40 for t in texts)


def test_invalid_requests_fail_alone(model_path, prompts, reference):
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512)
    bad = [
        ([], GREEDY, "empty_prompt"),
        ([0] + [7] * 300, GREEDY, "prompt_too_long"),
        ([0, 5, 10_000], GREEDY, "invalid_token_id"),
        (prompts[0], {"max_tokens": -3}, "bad_params"),
        (prompts[0], {"temprature": 0.5}, "bad_params"),
    ]
    # k above the vocabulary would fail the sampler's top-k for the whole batch; SamplingParams
    # caps k below any real vocabulary, so force one past this tiny model's 512 here.
    too_many = SamplingParams(max_tokens=4)
    object.__setattr__(too_many, "logprobs", 600)
    bad.append((prompts[0], too_many, "bad_params"))
    # A stop id past the vocabulary, suppressed under min_tokens, would fail the batch's indexing.
    bad.append((prompts[0], {"stop_token_ids": [10**9], "min_tokens": 2}, "bad_params"))
    # More tokens than any prompt leaves room for: refused by name (request_checks.py).
    bad.append((prompts[0], {"max_tokens": 10_000_000}, "bad_params"))
    bad.append(([0, True, 5], GREEDY, "invalid_token_id"))  # JSON true is no token id
    batch = [prompts[1]] + [b[0] for b in bad] + [prompts[2]]
    params = [GREEDY] + [b[1] for b in bad] + [GREEDY]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert outs[0].token_ids == reference[1] and outs[-1].token_ids == reference[2]
    for out, (_, _, code) in zip(outs[1:-1], bad):
        assert out.finish_reason == "error" and out.error_code == code and out.error
    assert "max_tokens" in outs[4].error and "temprature" in outs[5].error
    assert "logprobs=600 > vocab size 512" in outs[6].error
    assert "stop_token_ids: 1000000000 is not a token id (vocab size 512)" in outs[7].error
    assert "max_model_len=256" in outs[2].error
    assert outs[8].error.startswith("max_tokens=10000000: must be less than max_model_len=256")


def test_engine_refusals_are_the_shared_request_checks(model_path, prompts):
    # The planner runs check_request on every row (run and validate); the engine must refuse
    # exactly those requests, with the same code and message.
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512)
    cases = [
        ([0, 5, 10_000], GREEDY),
        ([0, -1], GREEDY),
        (prompts[0], SamplingParams(max_tokens=256)),
        (prompts[0], SamplingParams(max_tokens=4, stop_token_ids=[512])),
        ([0] + [7] * 250, SamplingParams(max_tokens=6)),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for out, (ids, params) in zip(outs, cases):
        expected = check_request(ids, params, llm.engine.limits)
        assert expected is not None
        assert (out.error_code, out.error) == (expected.code, expected.message)
    assert llm.engine.limits == ModelLimits(256, 512)


def test_stop_strings_min_tokens_and_logprobs(model_path, prompts, reference):
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512)
    full = llm.generate([prompts[3]], GREEDY, use_tqdm=False)[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    out = llm.generate(
        [prompts[3]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    lp = llm.generate(
        [prompts[3]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3), use_tqdm=False
    )[0]
    assert len(lp.logprobs) == 5
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert token in entry and entry[token] == max(entry.values()) and len(entry) == 3
    eos = next(iter(llm.engine.eos_token_ids))
    stopping = [i for i, r in enumerate(reference) if r and r[-1] == eos and len(r) < 10]
    if stopping:
        i = stopping[0]
        forced = llm.generate(
            [prompts[i]],
            SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),
            use_tqdm=False,
        )[0]
        assert len(forced.token_ids) == 12 and eos not in forced.token_ids


def test_startup_refuses_a_cache_that_cannot_hold_one_max_length_request(model_path):
    from batchgen.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"KV cache holds 64 tokens, fewer than one "
        r"max_model_len=256 request",
    ):
        LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=4, block_size=16)


def test_engine_stats_count_tokens(model_path, prompts):
    llm = LLM(model_path, dtype="float32", max_model_len=256, num_kv_blocks=512)
    outs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
    stats = llm.stats.as_dict()
    assert stats["requests"] == 4 and stats["errors"] == 0
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts[:4])
    assert stats["generated_tokens"] == sum(len(o.token_ids) for o in outs)
    assert stats["steps"] >= max(len(o.token_ids) for o in outs)
