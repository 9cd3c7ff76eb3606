"""Every field of an OpenAI batch request body is honoured, accepted without effect, or refused
by name; the tables in openai_request.py are checked field by field."""

from __future__ import annotations

import pytest

from batchgen.plan.openai_request import (
    CHAT_NEUTRAL,
    CHAT_NO_EFFECT,
    CHAT_REFUSED,
    CHAT_URL,
    COMPLETIONS_NEUTRAL,
    COMPLETIONS_NO_EFFECT,
    COMPLETIONS_REFUSED,
    COMPLETIONS_URL,
    parse_body,
)
from batchgen.plan.prompts import PromptError

MESSAGES = [{"role": "user", "content": "hi"}]
# A value for each refused or neutral field that asks for something batchgen does not do.
ASKING = {
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
    "stream": True,
    "logit_bias": {"42": 5},
    "modalities": ["text", "audio"],
    "echo": True,
    "suffix": "end",
}


def chat(**fields):
    return parse_body(CHAT_URL, {"messages": MESSAGES, **fields})


def completion(**fields):
    return parse_body(COMPLETIONS_URL, {"prompt": "hi", **fields})


def refused(parse, field, value) -> str:
    with pytest.raises(PromptError) as e:
        parse(**{field: value})
    assert e.value.code == "unsupported_field"
    assert f"body.{field}" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("field", [*CHAT_REFUSED, *CHAT_NEUTRAL])
def test_chat_fields_asking_for_what_batchgen_lacks_are_refused(field):
    refused(chat, field, ASKING[field])


@pytest.mark.parametrize("field", [*COMPLETIONS_REFUSED, *COMPLETIONS_NEUTRAL])
def test_completions_fields_asking_for_what_batchgen_lacks_are_refused(field):
    refused(completion, field, ASKING[field])


@pytest.mark.parametrize("parse", [chat, completion])
def test_unknown_fields_are_refused_and_all_named(parse):
    message = refused(parse, "frobnicate", 1)
    assert "not a field of" in message
    with pytest.raises(PromptError) as e:
        parse(frobnicate=1, stream=True, logit_bias={"1": 2})
    assert all(f"body.{f}" in str(e.value) for f in ("frobnicate", "stream", "logit_bias"))


def test_fields_of_the_other_endpoint_are_refused():
    refused(completion, "messages", MESSAGES)
    refused(completion, "max_completion_tokens", 5)
    refused(completion, "top_logprobs", 2)
    refused(chat, "prompt", "x")
    refused(chat, "echo", False)
    refused(chat, "best_of", 1)


def test_response_format_text_only_for_now():
    assert chat(response_format={"type": "text"}).params == {}
    message = refused(chat, "response_format", {"type": "json_schema", "json_schema": {}})
    assert "json_schema" in message


def test_neutral_values_and_no_effect_fields_change_nothing():
    neutral = {k: v for k, (v, _) in CHAT_NEUTRAL.items()}
    no_effect = dict.fromkeys(CHAT_NO_EFFECT, "x")
    assert chat(**neutral, **no_effect).params == {}
    neutral = {k: v for k, (v, _) in COMPLETIONS_NEUTRAL.items()}
    no_effect = dict.fromkeys(COMPLETIONS_NO_EFFECT, "x")
    assert completion(**neutral, **no_effect, best_of=1).params == {}
    assert completion(n=3, best_of=3).params == {"n": 3}
    refused(completion, "best_of", 4)
    assert chat(tools=None, stream=None).params == {}  # null is absent


def test_sampling_fields_map_onto_sampling_params():
    body = dict(
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        seed=7,
        stop=["x"],
        n=2,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.1,
        min_tokens=1,
        stop_token_ids=[3],
        ignore_eos=True,
    )
    assert chat(**body, max_completion_tokens=9).params == {**body, "max_tokens": 9}
    assert completion(**body, max_tokens=4).params == {**body, "max_tokens": 4}
    assert chat(max_tokens=6).params == {"max_tokens": 6}
    with pytest.raises(PromptError, match="differ"):
        chat(max_tokens=6, max_completion_tokens=7)


def test_logprobs_per_endpoint():
    assert chat(logprobs=True).params == {"logprobs": 0}
    assert chat(logprobs=True, top_logprobs=3).params == {"logprobs": 3}
    assert chat(logprobs=False).params == {}
    assert completion(logprobs=2).params == {"logprobs": 2}
    for parse, fields, message in [
        (chat, {"top_logprobs": 2}, "needs body.logprobs: true"),
        (chat, {"logprobs": 3}, "must be true or false"),
        (chat, {"logprobs": True, "top_logprobs": 21}, r"in \[0, 20\]"),
        (completion, {"logprobs": True}, "must be an integer"),
        (completion, {"logprobs": 50}, r"in \[0, 20\]"),
    ]:
        with pytest.raises(PromptError, match=message) as e:
            parse(**fields)
        assert e.value.code == "bad_params"


def test_messages_text_parts_developer_role_and_refusals():
    request = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok", "name": "bot"},
        ]
    )
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok", "name": "bot"},
    ]
    image = {"type": "image_url", "image_url": {"url": "x"}}
    for messages, named in [
        ([{"role": "user", "content": [image]}], "body.messages[0].content[0]"),
        ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "body.messages[0].tool_call_id"),
        ([{"role": "tool", "content": "x"}], "body.messages[0].role"),
        ([{"role": "assistant", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ]:
        with pytest.raises(PromptError, match=named.replace("[", r"\[")) as e:
            chat(messages=messages)
        assert e.value.code == "unsupported_field"
    with pytest.raises(PromptError, match="role") as e:
        chat(messages=[{"role": "robot", "content": "x"}])
    assert e.value.code == "bad_params"


def test_completion_prompt_forms():
    assert completion(prompt=[1, 2]).prompt == [1, 2]
    assert completion(prompt=["one"]).prompt == "one"
    refused(completion, "prompt", ["one", "two"])
    with pytest.raises(PromptError, match="body.prompt must be"):
        completion(prompt={"x": 1})
