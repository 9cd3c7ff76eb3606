"""Workload recipes: the nano RNG stream, vocab-safe ids, scaling and capping."""

from __future__ import annotations

import pytest

from batchgen.bench.workloads import WORKLOADS, build_workload, nano, warmup_workload


def test_nano_reproduces_the_nano_vllm_stream():
    w = nano()
    assert w.num_requests == 256
    assert w.num_prompt_tokens == 142_827
    assert w.num_output_tokens == 133_966
    assert w.temperature == 0.6


def test_nano_modulo_keeps_lengths_for_small_vocab():
    big, small = nano(8), nano(8, vocab_size=512)
    assert [len(p) for p in big.prompts] == [len(p) for p in small.prompts]
    assert big.max_tokens == small.max_tokens
    assert all(t < 512 for p in small.prompts for t in p)


@pytest.mark.parametrize("name", WORKLOADS)
def test_ids_are_vocab_safe_and_scaled(name):
    w = build_workload(name, vocab_size=512, num_prompts=4, max_output_tokens=8)
    assert w.num_requests == 4
    assert all(0 <= t < 512 for p in w.prompts for t in p)
    for cands in w.candidates or []:
        assert all(0 <= t < 512 for c in cands for t in c)
    assert all(m <= 8 for m in w.max_tokens)


def test_full_size_recipes():
    sp = build_workload("shared-prefix", vocab_size=128256)
    assert sp.num_requests == 64 * 16
    assert {len(p) for p in sp.prompts} == {2048 + 128}
    assert sp.prompts[0][:2048] == sp.prompts[15][:2048] != sp.prompts[16][:2048]
    assert sp.num_shared_tokens == 64 * 15 * 2048
    assert set(sp.max_tokens) == {256}
    summ = build_workload("summarize", vocab_size=128256)
    assert summ.num_requests == 1000 and set(summ.max_tokens) == {128}
    assert all(1500 <= len(p) <= 2500 for p in summ.prompts)
    score = build_workload("score", vocab_size=128256, num_prompts=8)
    assert {len(p) for p in score.prompts} == {512}
    assert all(len(c) == 16 and all(8 <= len(x) <= 64 for x in c) for c in score.candidates)
    pipe = build_workload("pipeline", vocab_size=128256, num_prompts=256)
    assert pipe.num_prompt_tokens == 142_827 and pipe.num_output_tokens == 133_966


def test_workloads_are_deterministic():
    assert (
        build_workload("score", 1000, 3).candidates == build_workload("score", 1000, 3).candidates
    )


def test_warmup_requests_differ_but_have_the_same_shape():
    w = build_workload("shared-prefix", vocab_size=1000, num_prompts=4)
    warm = warmup_workload(w, 1000, 2)
    assert [len(p) for p in warm.prompts] == [len(p) for p in w.prompts[:2]]
    assert warm.prompts[0] != w.prompts[0]
    assert all(m <= 16 for m in warm.max_tokens)


def test_warmup_grows_until_its_prompts_fill_a_step():
    w = nano(256, 1000)
    lengths = [len(p) for p in w.prompts]
    warm = warmup_workload(w, 1000, 4, min_prompt_tokens=16384)
    k = warm.num_requests
    # The fewest leading requests whose prompts hold a full 16,384-token step, never under 4.
    assert k > 4 and sum(lengths[:k]) >= 16384 > sum(lengths[: k - 1])
    assert [len(p) for p in warm.prompts] == lengths[:k]
    assert warmup_workload(w, 1000, 4, min_prompt_tokens=10).num_requests == 4
    # A budget no workload fills: every request warms up, and no more.
    assert warmup_workload(nano(3, 1000), 1000, 1, min_prompt_tokens=10**9).num_requests == 3
