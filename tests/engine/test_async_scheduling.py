"""Async scheduling (step N+1 launched before step N's tokens are read) changes nothing a user
sees: outputs, finish reasons, logprobs and scores equal the synchronous engine's, through
preemption, chunked prefill, stop tokens met one step late, n > 1 and scoring. Nor does the
admission interval (how often a full batch is refilled)."""

from __future__ import annotations

import random

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.scheduler import Scheduler
from batchgen.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


STOP_IDS = list(range(100, 140))


def _requests():
    """A mix of 40 generation requests (greedy that may hit EOS, seeded sampling, n = 3, stop
    ids, min_tokens, logprobs, penalties) and 6 score requests, as token ids."""
    rng = random.Random(11)
    gen = []
    for i in range(40):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(2, 90))]
        kind = i % 8
        if kind == 0:
            p = SamplingParams(max_tokens=30, temperature=0.0)
        elif kind == 1:
            p = SamplingParams(max_tokens=25, temperature=1.0, seed=i, top_p=0.9)
        elif kind == 2:
            p = SamplingParams(max_tokens=12, temperature=0.8, seed=i, n=3)
        elif kind == 3:
            # About 8% of the vocabulary stops: most of these end early, one step before the
            # async engine learns of it.
            p = SamplingParams(max_tokens=30, temperature=1.2, seed=i, stop_token_ids=STOP_IDS)
        elif kind == 4:
            p = SamplingParams(
                max_tokens=16, min_tokens=6, temperature=1.0, seed=i, stop_token_ids=STOP_IDS
            )
        elif kind == 5:
            p = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
        elif kind == 6:
            # Penalties read the histories on the device, the in-flight token included.
            p = SamplingParams(max_tokens=4, temperature=0.7, seed=i, repetition_penalty=1.3)
        else:
            p = SamplingParams(max_tokens=40, temperature=1.5, seed=i, ignore_eos=True)
        gen.append((f"g{i}", prompt, p))
    score = []
    for i in range(6):
        prompt = [0] + [rng.randrange(5, 500) for _ in range(rng.randrange(20, 60))]
        cands = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
        score.append((f"s{i}", prompt, cands))
    return gen, score


def _run(model_path, async_scheduling: bool, **options):
    config = EngineConfig(
        model=model_path,
        dtype="float32",
        max_model_len=256,
        async_scheduling=async_scheduling,
        **options,
    )
    engine = LLMEngine(config)
    gen, score = _requests()
    for rid, prompt, params in gen:
        engine.add_request(rid, prompt, params)
    for rid, prompt, cands in score:
        engine.add_score_request(rid, prompt, cands, return_token_logprobs=True)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in results, f"{out.request_id} returned twice"
            results[out.request_id] = out
    assert len(results) == len(gen) + len(score)
    return results, engine


def _view(out):
    """Exact fields, and the float ones (fp32 sums, whose batch mates may differ) apart."""
    exact = [(o.token_ids, o.finish_reason, o.text) for o in out.outputs]
    exact += [[sorted(e) for e in o.logprobs or []] for o in out.outputs]
    exact += [(s.num_tokens, s.greedy_match) for s in out.scores or []]
    floats = [v for o in out.outputs for e in o.logprobs or [] for _, v in sorted(e.items())]
    floats += [x for s in out.scores or [] for x in [s.score, *s.token_logprobs]]
    return (exact, out.error), floats


def _same(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        (exact_g, floats_g), (exact_w, floats_w) = _view(got[rid]), _view(want[rid])
        assert exact_g == exact_w, rid
        assert floats_g == pytest.approx(floats_w, abs=1e-4), rid


@pytest.mark.parametrize(
    "options",
    [
        {"num_kv_blocks": 512},
        {"num_kv_blocks": 40, "block_size": 8},  # preemption
        {"num_kv_blocks": 512, "max_num_batched_tokens": 13, "block_size": 8},  # chunked
        {"num_kv_blocks": 512, "enable_prefix_caching": False, "max_num_seqs": 5},
    ],
    ids=["plain", "preemption", "chunked-prefill", "no-cache-few-seqs"],
)
def test_async_outputs_equal_sync(model_path, options, monkeypatch):
    sync, sync_engine = _run(model_path, False, **options)
    patches, dropped = [], []
    pending_patch = ModelRunner._pending_patch
    resolve_token = Scheduler.resolve_token

    def spy_patch(self, rows, sources, tokens):
        patches.append(len(rows))
        return pending_patch(self, rows, sources, tokens)

    def spy_resolve(self, seq, index, token):
        kept = resolve_token(self, seq, index, token)
        dropped.append(not kept)
        return kept

    monkeypatch.setattr(ModelRunner, "_pending_patch", spy_patch)
    monkeypatch.setattr(Scheduler, "resolve_token", spy_resolve)
    got, engine = _run(model_path, True, **options)
    _same(got, sync)
    # The async path really ran: inputs read on the device, and tokens sampled after a stop
    # token dropped.
    assert sum(patches) > 0 and any(dropped)
    reasons = {o.finish_reason for out in got.values() for o in out.outputs}
    assert {"stop", "length"} <= reasons
    s, a = sync_engine.stats, engine.stats
    assert (a.num_generated_tokens, a.num_scored_tokens) == (
        s.num_generated_tokens,
        s.num_scored_tokens,
    )
    if options["num_kv_blocks"] == 40:
        assert a.num_preemptions > 0  # (which blocks stay cached then depends on timing)
    else:
        assert a.num_cached_tokens == s.num_cached_tokens
    # Nothing left behind: every block back in the pool.
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "options",
    [
        {"num_kv_blocks": 512, "max_num_seqs": 5},  # full by sequence slots
        {"num_kv_blocks": 40, "block_size": 8},  # full by KV blocks, with preemption
    ],
    ids=["seq-slots", "kv-blocks"],
)
def test_admission_interval_outputs_equal(model_path, options, monkeypatch):
    attempts = {}
    schedule_waiting = Scheduler._schedule_waiting

    def run(interval):
        calls = attempts[interval] = []

        def spy(self, *args):
            full = schedule_waiting(self, *args)
            calls.append(full)
            return full

        monkeypatch.setattr(Scheduler, "_schedule_waiting", spy)
        return _run(model_path, True, admission_interval=interval, **options)

    want, _ = run(1)
    got, engine = run(6)
    _same(got, want)
    # The batch did fill, and the interval then skipped admission attempts.
    assert any(attempts[6]) and len(attempts[6]) < len(attempts[1])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
