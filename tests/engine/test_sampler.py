"""Sampler: filtering masks, penalties, and keyed randomness that follows the distribution."""

from __future__ import annotations

import math

import torch
from batchgen.kernels.sampling import gumbel_argmax_ref
from batchgen.kernels.top_k_top_p import top_k_top_p_mask_ref, top_k_top_p_sample_ref

from batchgen.engine.penalties import History, apply_penalties_ref
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.sampling_params import SamplingParams


def batch(params, seeds=None, steps=None, prompt=None, output=None, suppress=None):
    """prompt / output: per-row histories, given to the rows whose params have a penalty."""
    n = len(params)
    prompt, output = prompt or [[]] * n, output or [[]] * n
    histories = [
        History(i, prompt[i] + output[i], len(prompt[i])) if p.has_penalties else None
        for i, p in enumerate(params)
    ]
    return SamplingBatch(
        params, seeds or [0] * n, steps or [0] * n, histories, suppress or [[]] * n
    )


def test_filtered_rows_draw_from_their_kept_set():
    # top-k / top-p / min-p rows straight from the model's logits (the direct path), mixed with
    # unfiltered rows: each draw is the reference's, inside its row's kept set.
    logits = 2 * torch.randn(24, 300, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.5 + 0.1 * (i % 5), top_k=(0, 5, 0, 40)[i % 4],
                       top_p=(1.0, 0.9, 0.3)[i % 3], min_p=(0.0, 0.2)[i % 2])
        for i in range(24)
    ]  # fmt: skip
    seeds, steps = list(range(24)), [i % 3 for i in range(24)]
    b = batch(params, seeds=seeds, steps=steps)
    assert Sampler._direct(b)
    tokens, _ = Sampler()(logits.clone(), b)
    temps = torch.tensor([p.temperature for p in params])
    kw = {
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int32),
        "top_p": torch.tensor([p.top_p for p in params]),
        "min_p": torch.tensor([p.min_p for p in params]),
    }
    want = top_k_top_p_sample_ref(logits, torch.tensor(seeds), torch.tensor(steps), temps, **kw)
    assert tokens == want.tolist()
    kept = top_k_top_p_mask_ref(logits / temps[:, None], **kw)
    assert all(kept[r, t] for r, t in enumerate(tokens))
    assert kept.sum(dim=1).min() < 300  # the filters removed something


def test_sampling_frequencies_follow_probabilities():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(probs).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _ = Sampler()(logits, batch(params, seeds=list(range(4000)), steps=[3] * 4000))
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    # 4000 draws: a 4-sigma band for each frequency.
    for f, p in zip(freq.tolist(), probs.tolist()):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / 4000)


def test_same_seed_and_step_same_token_other_step_varies():
    logits = torch.zeros(1, 1000)
    s = Sampler()
    p = [SamplingParams(temperature=1.0)]
    a = s(logits.clone(), batch(p, seeds=[42], steps=[0]))[0]
    assert a == s(logits.clone(), batch(p, seeds=[42], steps=[0]))[0]
    draws = {s(logits.clone(), batch(p, seeds=[42], steps=[k]))[0][0] for k in range(20)}
    assert len(draws) > 10


def test_min_p_and_suppression_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler()
    tokens, _ = s(logits.clone(), batch([SamplingParams(temperature=0.0)], suppress=[[0]]))
    assert tokens == [1]
    seen = set()
    for seed in range(200):
        params = [SamplingParams(temperature=1.0, min_p=0.5)]
        seen.add(s(logits.clone(), batch(params, seeds=[seed]))[0][0])
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5: tokens 2 and 3 are never drawn


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    s = Sampler()
    rep = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert s(logits.clone(), batch(rep, prompt=[[0]]))[0] == [1]  # 2.0 / 2 < 1.9
    freq = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    assert s(logits.clone(), batch(freq, output=[[0]]))[0] == [1]  # 2.0 - 0.2 < 1.9
    pres = [SamplingParams(temperature=0.0, presence_penalty=0.05)]
    assert s(logits.clone(), batch(pres, output=[[0, 0, 0]]))[0] == [0]  # once, not per count


def _divided_draws(logits, params, seeds, steps):
    """Divide by each row's temperature, then draw: the unfused rule."""
    temps = torch.tensor([p.temperature for p in params])
    return gumbel_argmax_ref(
        logits / temps[:, None], torch.tensor(seeds), torch.tensor(steps)
    ).tolist()


def test_temperature_only_batches_take_the_fused_path_with_the_same_draws(monkeypatch):
    logits = 3 * torch.randn(64, 500, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.2 + 0.05 * i) for i in range(64)]
    seeds, steps = list(range(64)), [i % 7 for i in range(64)]
    b = batch(params, seeds=seeds, steps=steps)
    assert Sampler._direct(b)
    want = _divided_draws(logits, params, seeds, steps)
    assert want != _divided_draws(logits, [SamplingParams()] * 64, seeds, steps)
    fused, _ = Sampler().sample(logits.clone(), b)
    assert fused.tolist() == want
    assert Sampler._direct(batch([SamplingParams(temperature=0.5, top_k=5, top_p=0.9)]))
    for other in ({"temperature": 0.0}, {"logprobs": 2}, {"repetition_penalty": 1.2}):
        assert not Sampler._direct(batch([SamplingParams(**{"temperature": 0.5, **other})]))
    assert not Sampler._direct(batch([SamplingParams(temperature=0.5)], suppress=[[3]]))
    monkeypatch.setattr(Sampler, "_direct", staticmethod(lambda batch: False))
    general, _ = Sampler().sample(logits.clone(), b)  # float32 copy first, same draw
    assert general.tolist() == want


def test_penalised_rows_draw_as_penalties_then_division():
    logits = 3 * torch.randn(16, 40, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.3 + 0.1 * i, repetition_penalty=1.5, frequency_penalty=0.5)
        for i in range(16)
    ]
    top = logits.topk(3).indices.tolist()  # penalise each row's likeliest ids
    prompt = [[t[0], 7] for t in top]
    output = [[t[1], t[1], t[2]] for t in top]
    seeds, steps = list(range(16)), [3] * 16
    penalised = logits.clone()
    apply_penalties_ref(
        penalised, [History(i, prompt[i] + output[i], 2) for i in range(16)], params
    )
    want = _divided_draws(penalised, params, seeds, steps)
    got, _ = Sampler().sample(logits.clone(), batch(params, seeds, steps, prompt, output))
    assert got.tolist() == want
    assert want != _divided_draws(logits, params, seeds, steps)  # the penalties count


def test_sizes_past_the_vocabulary_do_not_fail_the_batch():
    # The engine refuses such requests (bad_params), but one reaching the sampler must still not
    # index the [N, V] logits past V, which would fail every row of the step.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2, 1)
    many = SamplingParams(temperature=0.0)
    object.__setattr__(many, "logprobs", 600)  # SamplingParams caps it at 100
    wide = SamplingParams(temperature=1.0, top_k=2**70)  # past int64, not only past V
    tokens, logprobs = Sampler()(logits, batch([many, wide], suppress=[[10**9, 2**70], []]))
    assert tokens[0] == 0 and 0 <= tokens[1] < 4
    assert sorted(logprobs[0]) == [0, 1, 2, 3] and logprobs[1] == {}
