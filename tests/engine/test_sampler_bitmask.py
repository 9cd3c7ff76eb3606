"""Sampler with a token bitmask: on every path (direct draw, filters, greedy, penalties,
logprobs, mixed rows) the draw equals the unmasked sampler's over logits masked beforehand, and
log-probs stay those of the raw logits."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.token_bitmask import bitmask_words

from batchgen.engine.penalties import History
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.sampling_params import SamplingParams

VOCAB, ROWS = 300, 12


def _mask(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros((len(allowed), bitmask_words(VOCAB)), dtype=torch.int64)
    for r, ids in enumerate(allowed):
        for i in ids:
            words[r, i // 32] |= 1 << (i % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    histories = [
        History(i, [5, 6, 7, 8 + i, 8 + i], 2) if p.has_penalties else None
        for i, p in enumerate(params)
    ]
    return SamplingBatch(params, list(range(ROWS)), [3] * ROWS, histories, [[]] * ROWS)


PATHS = {
    "direct": lambda i: SamplingParams(temperature=0.8),
    "filters": lambda i: SamplingParams(temperature=1.0, top_k=(0, 5)[i % 2], top_p=0.7),
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "penalties": lambda i: SamplingParams(temperature=1.0, repetition_penalty=1.5),
    "logprobs": lambda i: SamplingParams(temperature=1.0, logprobs=3),
    "mixed": lambda i: [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, frequency_penalty=0.5),
    ][i % 3],
}


@pytest.mark.parametrize("path", list(PATHS))
def test_masked_draw_equals_the_draw_over_premasked_logits(path):
    g = torch.Generator().manual_seed(len(path))
    logits = 3 * torch.randn(ROWS, VOCAB, generator=g)
    allowed = [
        set(torch.randperm(VOCAB, generator=g)[: (1, 3, 40, 200)[r % 4]].tolist())
        for r in range(ROWS)
    ]
    premasked = torch.full_like(logits, float("-inf"))
    for r, ids in enumerate(allowed):
        premasked[r, list(ids)] = logits[r, list(ids)]
    params = [PATHS[path](i) for i in range(ROWS)]
    got, got_lp = Sampler().sample(logits.clone(), _batch(params), _mask(allowed))
    want, _ = Sampler().sample(premasked, _batch(params))
    assert got.tolist() == want.tolist()
    assert all(t in ids for t, ids in zip(got.tolist(), allowed))
    free, _ = Sampler().sample(logits.clone(), _batch(params))
    assert free.tolist() != got.tolist()  # the mask changed some draw
    if path == "logprobs":  # log-probs of the raw logits, not the masked ones
        torch.testing.assert_close(got_lp, torch.log_softmax(logits, dim=-1))
