"""On a CUDA device: constrained generation (masks uploaded on a side stream, applied inside
the Triton sampling kernels, CUDA-graph decode) draws the CPU path's tokens, and every output
follows its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batchgen import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_constrained_gpu_equals_cpu(tiny_model_dir, async_scheduling):
    path = tiny_model_dir("qwen3")
    common = dict(dtype="float32", max_model_len=512, num_kv_blocks=1024, max_num_seqs=16)
    prompts = [f"Record {i} as JSON:" for i in range(24)]
    kinds = [{}, {"top_p": 0.9}, {"temperature": 0.0}, {"repetition_penalty": 1.2}]
    params = [
        SamplingParams(
            max_tokens=96,
            **{"temperature": 0.9, "seed": i, **kinds[i % 4]},
            structured_outputs={"json": SCHEMA},
        )
        for i in range(24)
    ]
    cpu = LLM(path, device="cpu", **common).generate(prompts, params, use_tqdm=False)
    gpu_llm = LLM(path, device="cuda", async_scheduling=async_scheduling, **common)
    gpu = gpu_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    stops = [o for o in gpu if o.finish_reason == "stop"]
    assert len(stops) >= 20
    for o in stops:
        jsonschema.validate(json.loads(o.text), SCHEMA)
