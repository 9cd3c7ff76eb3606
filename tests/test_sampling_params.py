"""SamplingParams validation names the field at fault."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from batchgen.sampling_params import (
    MAX_N,
    MAX_SCALE,
    MIN_SCALE,
    SamplingParams,
    SamplingParamsError,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 101}, "logprobs"),
        # NaN fails every comparison, so each range check must also ask for a finite number.
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        # Finite, but 0 or inf once in float32 (the logits are divided by them): inf/NaN logits.
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": 1e300}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"stop": 5}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_stop_accepts_string_and_list():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    assert SamplingParams(temperature=0).greedy


def test_error_quotes_a_huge_value_briefly():
    # Shared references (what YAML aliases build) make a tiny document a vast value.
    value = ["x" * 10_000]
    for _ in range(6):
        value = [value] * 9
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(stop=value)
    assert len(str(e.value)) < 400 and "SamplingParams.stop=" in str(e.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_refuses_non_finite_values(value):
    names = [f.name for f in fields(SamplingParams) if "float" in str(f.type)]
    assert {"temperature", "top_p", "min_p", "repetition_penalty"} <= set(names)
    for name in names:
        with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{name}=(nan|-?inf):"):
            SamplingParams(**{name: value})


def test_scale_range_edges_are_accepted():
    for value in (MIN_SCALE, MAX_SCALE):
        assert SamplingParams(temperature=value, repetition_penalty=value)
    assert SamplingParams(temperature=0).greedy


def test_n_is_bounded_and_errors_carry_the_field():
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.n=100000: .*\[1, {MAX_N}\]"):
        SamplingParams(n=100_000)
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(top_p=2)
    assert info.value.field == "top_p"
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(stop=5)
    assert info.value.field == "stop"
