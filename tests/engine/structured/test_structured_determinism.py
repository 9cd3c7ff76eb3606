"""Constrained sampled rows are a function of their own seed: the same tokens alone, in a mixed
batch, from a fresh engine (a resumed run), with synchronous scheduling, under preemption by
recompute, and as sample 0 of an n > 1 request."""

from __future__ import annotations

import json

import jsonschema
import pytest
from structured_schemas import MAX_TOKENS, SCHEMAS

from batchgen import LLM, SamplingParams

ROWS = [
    ("person", {}),
    ("order", {"top_p": 0.8}),
    ("reading", {"top_k": 5}),
    ("event", {"repetition_penalty": 1.3}),
    ("tags", {"temperature": 0.0}),
    ("person", {"presence_penalty": 0.5}),
]


def _rows():
    prompts, params = [], []
    for i, (name, extra) in enumerate(ROWS):
        prompts.append(f"Give the {name} of row {i} as JSON:")
        kw = {"temperature": 1.0, "seed": 100 + i, **extra}
        params.append(
            SamplingParams(
                max_tokens=MAX_TOKENS[name], structured_outputs={"json": SCHEMAS[name]}, **kw
            )
        )
    return prompts, params


def _noise():
    """Batch mates: unconstrained rows and rows under other constraints."""
    prompts = [f"noise {i}" for i in range(6)]
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(3)] + [
        SamplingParams(max_tokens=20, seed=i, structured_outputs={"regex": "[a-z]{3,9}"})
        for i in range(3)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _engine(model, **options) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, **options)


@pytest.fixture(scope="module")
def alone(model):
    llm = _engine(model)
    prompts, params = _rows()
    return [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]


def test_rows_are_valid(alone):
    for out, (name, _) in zip(alone, ROWS):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_same_tokens_in_a_mixed_batch(model, alone):
    prompts, params = _rows()
    noise_prompts, noise_params = _noise()
    # Interleaved with the batch mates, in another order.
    mixed_prompts = [x for pair in zip(noise_prompts, prompts[::-1]) for x in pair]
    mixed_params = [x for pair in zip(noise_params, params[::-1]) for x in pair]
    outs = _engine(model).generate(mixed_prompts, mixed_params, use_tqdm=False)
    got = [o.token_ids for o in outs[1::2]][::-1]
    assert got == [o.token_ids for o in alone]


@pytest.mark.parametrize(
    "options",
    [
        {},  # a fresh engine, as a resumed run has: only the rows not yet committed
        {"async_scheduling": False},
        {"num_kv_blocks": 40, "block_size": 8, "max_num_seqs": 8},  # preemption by recompute
        {"enable_prefix_caching": False},
    ],
    ids=["resume", "sync", "preemption", "no-prefix-cache"],
)
def test_same_tokens_from_another_engine(model, alone, options):
    prompts, params = _rows()
    noise_prompts, noise_params = _noise()
    llm = _engine(model, **options)
    outs = llm.generate(prompts[2:] + noise_prompts * 2, params[2:] + noise_params * 2, False)
    assert [o.token_ids for o in outs[: len(prompts) - 2]] == [o.token_ids for o in alone[2:]]
    if "num_kv_blocks" in options:
        assert llm.stats.num_preemptions > 0


def test_n_samples_each_follow_the_schema(model, alone):
    prompts, params = _rows()
    name = ROWS[0][0]
    p = params[0]
    multi = SamplingParams(
        n=4,
        max_tokens=p.max_tokens,
        temperature=1.0,
        seed=p.seed,
        structured_outputs=p.structured_outputs,
    )
    out = _engine(model).generate([prompts[0]], [multi], use_tqdm=False)[0]
    assert len(out.outputs) == 4
    # Sample 0 draws with the request's first sample key, as the n = 1 request did.
    assert out.outputs[0].token_ids == alone[0].token_ids
    for sample in out.outputs:
        assert sample.finish_reason == "stop" and sample.incomplete is False
        jsonschema.validate(json.loads(sample.text), SCHEMAS[name])
    assert len({s.text for s in out.outputs}) > 1
