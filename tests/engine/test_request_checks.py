"""The request checks the engine and the planner share (so validate predicts the run)."""

from __future__ import annotations

import pytest

from batchgen.engine.request_checks import (
    ModelLimits,
    check_cache_size,
    check_length,
    check_params,
    check_request,
    check_token_ids,
)
from batchgen.sampling_params import SamplingParams

LIMITS = ModelLimits(max_model_len=64, vocab_size=100)


def test_limits_take_the_smaller_max_model_len():
    assert ModelLimits.of(4096, 512, None) == ModelLimits(4096, 512)
    assert ModelLimits.of(4096, 512, 256) == ModelLimits(256, 512)
    assert ModelLimits.of(128, 512, 256) == ModelLimits(128, 512)  # past the model's: its own


@pytest.mark.parametrize("ids", [[1, 100], [-1], [1, True], [1, "2"], [1.0], [10**30]])
def test_ids_outside_the_vocabulary(ids):
    error = check_token_ids(ids, 100, "prompt")
    assert error.code == "invalid_token_id" and error.field is None
    assert error.message.startswith("prompt has token id(s) outside [0, 100): ")


def test_ids_inside_the_vocabulary_or_unchecked():
    assert check_token_ids([0, 99], 100, "prompt") is None
    assert check_token_ids(iter([0, 99]), 100, "prompt") is None  # any iterable of ids
    assert check_token_ids((), 100, "prompt") is None  # emptiness is the caller's rule
    assert check_token_ids((5, 100), 100, "candidate 0").message.endswith("[100]")
    assert check_token_ids([10**9], None, "prompt") is None  # a stand-in engine: no vocabulary


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"max_tokens": 64}, "max_tokens", "max_tokens=64: must be less than max_model_len=64"),
        ({"max_tokens": 10_000_000}, "max_tokens", "max_tokens=10000000: must be less than"),
        ({"stop_token_ids": [5, 100]}, "stop_token_ids", "stop_token_ids: 100 is not a token id"),
    ],
)
def test_params_no_prompt_could_satisfy(kwargs, field, message):
    error = check_params(SamplingParams(**kwargs), LIMITS)
    assert error.code == "bad_params" and error.field == field
    assert error.message.startswith(message)


def test_logprobs_past_a_small_vocabulary():
    # SamplingParams caps logprobs at MAX_LOGPROBS; only a smaller vocabulary goes below it.
    error = check_params(SamplingParams(logprobs=60), ModelLimits(64, 50))
    assert error.code == "bad_params" and error.field == "logprobs"
    assert error.message == "logprobs=60 > vocab size 50"


def test_params_that_fit():
    params = SamplingParams(max_tokens=63, logprobs=5, stop_token_ids=[99])
    assert check_params(params, LIMITS) is None


def test_length_is_prompt_plus_max_tokens():
    assert check_length(60, 4, 64) is None
    error = check_length(61, 4, 64)
    assert error.code == "prompt_too_long"
    assert error.message.startswith("prompt has 61 tokens + max_tokens 4 = 65, more than ")


def test_request_checks_in_the_engines_order():
    params = SamplingParams(max_tokens=64)
    assert check_request([100], params, LIMITS).code == "invalid_token_id"  # ids first
    assert check_request([1], params, LIMITS).code == "bad_params"
    assert check_request([1] * 61, SamplingParams(max_tokens=4), LIMITS).code == "prompt_too_long"
    assert check_request([1] * 60, SamplingParams(max_tokens=4), LIMITS) is None


def test_cache_must_hold_one_max_model_len_request():
    assert check_cache_size(256, 256) is None
    assert "holds 64 tokens, fewer than one max_model_len=256" in check_cache_size(64, 256)
