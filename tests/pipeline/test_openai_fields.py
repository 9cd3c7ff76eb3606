"""OpenAI batch input end to end on the tiny model: each refused field is a per-row error naming
it, each honoured one shows in the output (logprobs in OpenAI's shapes, n, stop, seed, ...)."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from workspace import write_jsonl

from batchgen.job import load_job
from batchgen.pipeline.runner import Runner
from batchgen.plan.openai_request import CHAT_REFUSED, CHAT_URL, COMPLETIONS_URL

ENGINE = {"max_num_seqs": 16, "num_kv_blocks": 256, "max_model_len": 256, "dtype": "float32"}
MESSAGES = [{"role": "user", "content": "the committee measured the river"}]
REFUSED_VALUES = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "stream_options": {"include_usage": True},
}


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_batch_file(tmp_path, monkeypatch, model: str, lines: list[dict]) -> dict[str, dict]:
    write_jsonl(tmp_path / "batch.jsonl", lines)
    job = {
        "model": {"path": model, **ENGINE},
        "input": {"path": "batch.jsonl"},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "output": {"path": "out", "format": "openai-batch"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    monkeypatch.chdir(tmp_path)
    assert Runner(load_job("job.yaml")).run().complete
    out = [json.loads(x) for x in (tmp_path / "out/part-00000.jsonl").read_text().splitlines()]
    return {o["custom_id"]: o for o in out}


def test_refused_fields_are_row_errors_naming_them(tmp_path, monkeypatch, tiny_model_dir):
    assert set(REFUSED_VALUES) == set(CHAT_REFUSED)
    lines = [line("ok", CHAT_URL, messages=MESSAGES)]
    lines += [line(f, CHAT_URL, messages=MESSAGES, **{f: v}) for f, v in REFUSED_VALUES.items()]
    lines += [
        line("stream", CHAT_URL, messages=MESSAGES, stream=True),
        line("bias", COMPLETIONS_URL, prompt="x", logit_bias={"5": 1}),
        line("echo", COMPLETIONS_URL, prompt="x", echo=True),
        line("json", CHAT_URL, messages=MESSAGES, response_format={"type": "json_object"}),
        line("unknown", CHAT_URL, messages=MESSAGES, temprature=0.5),
    ]
    out = run_batch_file(tmp_path, monkeypatch, tiny_model_dir("llama"), lines)
    assert out["ok"]["error"] is None and out["ok"]["response"]["status_code"] == 200
    named = {**{f: f for f in REFUSED_VALUES}, "stream": "stream", "bias": "logit_bias"}
    named.update(echo="echo", json="response_format", unknown="temprature")
    for custom_id, field in named.items():
        error = out[custom_id]["error"]
        assert out[custom_id]["response"] is None
        assert error["code"] == "unsupported_field", custom_id
        assert f"body.{field}" in error["message"], error["message"]


def test_honoured_fields_show_in_the_output(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    plain = run_batch_file(
        tmp_path / "a", monkeypatch, model, [line("free", CHAT_URL, messages=MESSAGES)]
    )
    free_text = plain["free"]["response"]["body"]["choices"][0]["message"]["content"]
    stop = free_text[3:6]  # a piece of the unconstrained greedy reply
    lines = [
        line("lp", CHAT_URL, messages=MESSAGES, logprobs=True, top_logprobs=3, max_tokens=5),
        line("lp0", CHAT_URL, messages=MESSAGES, logprobs=True),
        line("clp", COMPLETIONS_URL, prompt="a small town", logprobs=2, max_tokens=5),
        line("n", COMPLETIONS_URL, prompt="a small town", n=3, temperature=1.0),
        line("stop", CHAT_URL, messages=MESSAGES, stop=[stop]),
        line("seed1", CHAT_URL, messages=MESSAGES, temperature=1.0, seed=11, max_tokens=12),
        line("seed2", CHAT_URL, messages=MESSAGES, temperature=1.0, seed=11, max_tokens=12),
        line("mct", CHAT_URL, messages=MESSAGES, max_completion_tokens=9, ignore_eos=True),
        line(
            "quiet",
            CHAT_URL,
            messages=MESSAGES,
            model="any",
            user="u",
            metadata={"k": "v"},
            store=False,
            service_tier="auto",
            stream=False,
            response_format={"type": "text"},
        ),
    ]
    (tmp_path / "b").mkdir()
    out = run_batch_file(tmp_path / "b", monkeypatch, model, lines)
    body = {k: v["response"]["body"] for k, v in out.items() if v["error"] is None}
    assert set(body) == {x["custom_id"] for x in lines}, {k: v["error"] for k, v in out.items()}

    choice = body["lp"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["lp"]["usage"]["completion_tokens"] == 5
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 3
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and item["logprob"] <= tops[0] + 1e-6
        assert all(set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"])
        assert math.isfinite(item["logprob"]) and item["logprob"] <= 0
    if choice["finish_reason"] == "length":  # no EOS token among them
        raw = b"".join(bytes(item["bytes"]) for item in content)
        assert raw.decode("utf-8", "replace") == choice["message"]["content"]
    assert all(i["top_logprobs"] == [] for i in body["lp0"]["choices"][0]["logprobs"]["content"])
    assert body["quiet"]["choices"][0]["logprobs"] is None

    logprobs = body["clp"]["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert logprobs["text_offset"][0] == 0
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]
    assert logprobs["text_offset"] == offsets
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    ):
        assert 2 <= len(top) <= 3 and top[token] == logprob

    assert len(body["n"]["choices"]) == 3
    assert [c["index"] for c in body["n"]["choices"]] == [0, 1, 2]
    stopped = body["stop"]["choices"][0]
    assert stopped["message"]["content"] == free_text[: free_text.index(stop)]
    assert stopped["finish_reason"] == "stop"
    seeded = [body[k]["choices"][0]["message"]["content"] for k in ("seed1", "seed2")]
    assert seeded[0] == seeded[1]  # the row seed would differ by custom_id: the body's is used
    assert body["mct"]["usage"]["completion_tokens"] == 9
    assert body["quiet"]["choices"][0]["message"]["content"] == free_text


@pytest.mark.parametrize("k", [1, 4])
def test_top_logprobs_equal_the_engine_logprobs(tmp_path, monkeypatch, tiny_model_dir, k):
    """The response's numbers are the engine's own (LLM.generate with SamplingParams.logprobs)."""
    from batchgen import LLM, SamplingParams

    model = tiny_model_dir("llama")
    out = run_batch_file(
        tmp_path,
        monkeypatch,
        model,
        [line("c", COMPLETIONS_URL, prompt="our team", logprobs=k, max_tokens=4)],
    )
    got = out["c"]["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    llm = LLM(model, **ENGINE)
    ref = llm.generate(["our team"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=k))[0]
    assert got == pytest.approx([lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
