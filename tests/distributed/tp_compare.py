"""What the tensor-parallel CPU tests compare between tensor_parallel_size 1 and 2: a few ragged
prompts, a mix of sampling settings (greedy with log-probs, seeded top-p, n=2, a penalty), and
the two engines' generations and scores (tokens equal, log-probs and scores within a bound)."""

from __future__ import annotations

import random

from batchgen import SamplingParams


def random_prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def mixed_params(max_tokens: int, logprobs: int) -> list[SamplingParams]:
    """One setting a prompt of random_prompts(6)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    return [
        greedy,
        greedy,
        SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=max_tokens, temperature=1.0, n=2, seed=9),
        greedy,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.3),
    ]


def assert_same_generations(got, want, tol: float = 1e-4) -> None:
    """Equal tokens and finish reasons, the same top log-prob ids with values within tol, and a
    reference that did generate (distinct, non-trivial outputs)."""
    assert all(o.error is None for o in got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    for g, w in zip(got, want):
        if w.logprobs is None:
            continue
        for g_step, w_step in zip(g.logprobs, w.logprobs):
            assert g_step.keys() == w_step.keys()
            assert max(abs(g_step[t] - w_step[t]) for t in w_step) <= tol
    assert len({tuple(o.token_ids) for o in want}) > 1


def assert_same_scores(single, parallel, prompts: list[list[int]], tol: float = 1e-4) -> None:
    """LLM.score of three candidates after each of four prompt heads: equal token counts and
    greedy matches, scores and per-token log-probs within tol."""
    candidates = [[p[1:6], p[3:4], [7, 8, 9, 10]] for p in prompts[:4]]
    heads = [p[:20] for p in prompts[:4]]
    want = single.score(heads, candidates, return_token_logprobs=True, use_tqdm=False)
    got = parallel.score(heads, candidates, return_token_logprobs=True, use_tqdm=False)
    for g_row, w_row in zip(got, want):
        for g, w in zip(g_row, w_row):
            assert g.error is None and g.num_tokens == w.num_tokens
            assert abs(g.score - w.score) <= tol
            assert max(abs(a - b) for a, b in zip(g.token_logprobs, w.token_logprobs)) <= tol
            assert g.greedy_match == w.greedy_match
