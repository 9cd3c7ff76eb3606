"""Structured output under tensor parallel on CPU (gloo, two processes): rank 0 masks the
whole vocabulary's logits it gathered, so constrained rows (JSON schema, regex, choice; greedy,
sampled, top-k / top-p, penalties, n > 1, beside unconstrained rows) give the same tokens as
tensor_parallel_size 1, and every finished output satisfies its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from batchgen import LLM, SamplingParams
from batchgen.models.make_model import make_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
# Small chunks and blocks: prompts prefill over several steps and decode rows carry tokens still
# on the device (async scheduling), as in test_tp_engine.
OPTIONS = dict(
    dtype="float32", max_model_len=160, num_kv_blocks=160, block_size=8, max_num_batched_tokens=32
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(tensor_parallel_size 1 LLM, tensor_parallel_size 2 LLM) over one tiny llama."""
    path = str(tmp_path_factory.mktemp("tp-structured"))
    make_model(path, "llama", seed=2)
    single = LLM(path, **OPTIONS)
    parallel = LLM(path, tensor_parallel_size=2, **OPTIONS)
    yield single, parallel
    parallel.shutdown()


def _rows() -> tuple[list[str], list[SamplingParams], list[str]]:
    json_c = {"json": SCHEMA}
    rows = [
        ("json", SamplingParams(max_tokens=70, temperature=0.0, structured_outputs=json_c)),
        ("json", SamplingParams(max_tokens=70, temperature=1.0, seed=3, structured_outputs=json_c)),
        (
            "json",
            SamplingParams(
                max_tokens=70,
                temperature=0.9,
                top_p=0.9,
                top_k=20,
                seed=4,
                repetition_penalty=1.2,
                structured_outputs=json_c,
            ),
        ),  # fmt: skip
        (
            "regex",
            SamplingParams(
                max_tokens=20, temperature=1.0, seed=5, n=2, structured_outputs={"regex": REGEX}
            ),
        ),  # fmt: skip
        (
            "choice",
            SamplingParams(
                max_tokens=8, temperature=1.0, seed=6, structured_outputs={"choice": CHOICES}
            ),
        ),  # fmt: skip
        ("free", SamplingParams(max_tokens=12, temperature=1.0, seed=7)),
    ]
    prompts = [f"Row {i}, answer in {kind}:" for i, (kind, _) in enumerate(rows)]
    return prompts, [p for _, p in rows], [k for k, _ in rows]


def _check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text


def test_constrained_rows_equal_one_rank(engines):
    single, parallel = engines
    prompts, params, kinds = _rows()
    want = single.generate(prompts, params, use_tqdm=False)
    got = parallel.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in want + got)
    for g, w in zip(got, want):
        assert [s.token_ids for s in g.outputs] == [s.token_ids for s in w.outputs]
        assert [s.finish_reason for s in g.outputs] == [s.finish_reason for s in w.outputs]
        assert [s.incomplete for s in g.outputs] == [s.incomplete for s in w.outputs]
    stops = 0
    for out, kind in zip(got, kinds):
        for sample in out.outputs:
            if kind != "free" and sample.finish_reason == "stop":
                stops += 1
                _check_valid(kind, sample.text)
    assert stops >= 4, f"only {stops} constrained samples finished"
    # The sampled rows differ: the seeds reached the masked draws.
    assert got[1].outputs[0].text != got[2].outputs[0].text
