"""LLM.score equals transformers' log-likelihoods, computes prompts once, fails per candidate."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM

transformers = pytest.importorskip("transformers")

HEADER = (
    "Question: What did the committee measure? Answer: the annual budget.\n"
    "Question: What did our team review? Answer: the survey results.\n"
)
QUESTIONS = ["Question: What did the river delay? Answer:", "Question: Who approved it? Answer:"]
CANDIDATES = [" the harbor project", " a rainfall record on Monday", " yes", " the price of bread"]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=256, block_size=8)
    return llm, hf


def hf_loglik(hf, prompt_ids: list[int], cand_ids: list[int]) -> tuple[float, list[float]]:
    ids = torch.tensor([prompt_ids + cand_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    per_token = [logprobs[n - 1 + i, t].item() for i, t in enumerate(cand_ids)]
    return sum(per_token), per_token


@pytest.mark.parametrize("with_header", [False, True], ids=["plain", "few-shot-header"])
def test_scores_equal_transformers(setup, with_header):
    llm, hf = setup
    prompts = [(HEADER if with_header else "") + q for q in QUESTIONS]
    results = llm.score(
        prompts, [CANDIDATES] * len(prompts), return_token_logprobs=True, use_tqdm=False
    )
    lengths = set()
    for prompt, per_prompt in zip(prompts, results):
        assert len(per_prompt) == len(CANDIDATES)
        for cand, res in zip(CANDIDATES, per_prompt):
            prompt_ids = llm.tokenizer.encode(prompt)
            joined = llm.tokenizer.encode(prompt + cand)
            assert joined[: len(prompt_ids)] == prompt_ids
            cand_ids = joined[len(prompt_ids) :]
            ref, ref_tokens = hf_loglik(hf, prompt_ids, cand_ids)
            assert res.error is None
            assert res.num_tokens == len(cand_ids)
            assert abs(res.score - ref) <= 1e-4
            assert max(abs(a - b) for a, b in zip(res.token_logprobs, ref_tokens)) <= 1e-4
            assert abs(res.mean - ref / len(cand_ids)) <= 1e-4
            lengths.add(res.num_tokens)
    assert len(lengths) > 1  # candidates of different lengths


def test_prompt_computed_once_per_group(setup):
    llm, _ = setup
    prompt = HEADER + QUESTIONS[0]
    prompt_len = len(llm.tokenizer.encode(prompt))
    before = llm.stats.num_cached_tokens
    llm.score([prompt], [CANDIDATES * 4], use_tqdm=False)  # 16 candidates
    # Candidate 0 computes the prompt; the other 15 reuse its full blocks (8 tokens each) and
    # compute only the prompt's partial last block and themselves.
    shared = (prompt_len - 1) // 8 * 8
    assert llm.stats.num_cached_tokens - before >= 15 * shared


def test_greedy_match_flag(setup):
    llm, hf = setup
    prompt_ids = llm.tokenizer.encode(QUESTIONS[0])
    greedy = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)
    cont = greedy[0, len(prompt_ids) :].tolist()
    other = [(cont[0] + 1) % 400 + 5] + cont[1:]
    (res,) = llm.score([prompt_ids], [[cont, other]], use_tqdm=False)
    assert res[0].greedy_match is True and res[1].greedy_match is False
    assert res[0].score > res[1].score


def test_bad_candidates_fail_alone(setup):
    llm, hf = setup
    long_candidate = " the" * 200
    (res,) = llm.score(
        [QUESTIONS[1]], [["", CANDIDATES[0], long_candidate, CANDIDATES[2]]], use_tqdm=False
    )
    assert res[0].error_code == "empty_candidate"
    assert res[2].error_code == "prompt_too_long" and "max_model_len=128" in res[2].error
    prompt_ids = llm.tokenizer.encode(QUESTIONS[1])
    for i, cand in ((1, CANDIDATES[0]), (3, CANDIDATES[2])):
        cand_ids = llm.tokenizer.encode(QUESTIONS[1] + cand)[len(prompt_ids) :]
        assert res[i].error is None
        assert abs(res[i].score - hf_loglik(hf, prompt_ids, cand_ids)[0]) <= 1e-4
