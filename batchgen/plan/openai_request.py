"""OpenAI batch request bodies: each field of /v1/chat/completions and /v1/completions is honoured,
accepted without effect, or refused by name (a row error), so nothing is dropped silently.

A field whose value is null counts as absent. The tables below are the whole contract; the
README lists them for users.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchgen.plan.prompts import PromptError

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MAX_TOP_LOGPROBS = 20  # OpenAI's own limit for top_logprobs (completions' logprobs: 5)

# Honoured by both endpoints: body field -> SamplingParams field.
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
    "n": "n",
    # vLLM's extra sampling fields, which its server and `vllm run-batch` accept too.
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
# Honoured with their own handling below.
CHAT_HONOURED = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format")
COMPLETIONS_HONOURED = ("prompt", "logprobs")
# Cannot change the output: accepted and ignored.
CHAT_NO_EFFECT = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "parallel_tool_calls",  # says how tools are called; tools themselves are refused
)
COMPLETIONS_NO_EFFECT = ("model", "user")
# Accepted only with the value that does nothing: field -> (that value, its JSON text).
CHAT_NEUTRAL = {
    "stream": (False, "false"),
    "logit_bias": ({}, "{}"),
    "modalities": (["text"], '["text"]'),
}
COMPLETIONS_NEUTRAL = {
    "stream": (False, "false"),
    "logit_bias": ({}, "{}"),
    "echo": (False, "false"),
    "suffix": ("", '""'),
}
# Refused: field -> the feature batchgen does not have.
CHAT_REFUSED = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "verbosity": "verbosity",
    "web_search_options": "web search",
    "stream_options": "streaming (batch output is never streamed)",
}
COMPLETIONS_REFUSED = {"stream_options": "streaming (batch output is never streamed)"}
# best_of (completions) is accepted when it equals n: no selection happens then.
MESSAGE_KEYS = ("role", "content", "name")
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked request body: the prompt and the SamplingParams fields it sets."""

    chat: bool
    messages: list[dict[str, Any]] | None  # chat: for the chat template
    prompt: str | list[int] | None  # completions: text or token ids
    params: dict[str, Any]


def unsupported(fields: list[str], why: str) -> PromptError:
    named = ", ".join(f"body.{f}" for f in fields)
    return PromptError("unsupported_field", f"{named}: not supported by batchgen ({why})")


def parse_body(url: str, body: dict[str, Any]) -> OpenAIRequest:
    """Check every field of `body` for endpoint `url`; raises PromptError("unsupported_field")
    naming each refused field, or PromptError("bad_params") for a malformed value."""
    chat = url == CHAT_URL
    given = {k: v for k, v in body.items() if v is not None}
    honoured = (*SAMPLING_FIELDS, *(CHAT_HONOURED if chat else COMPLETIONS_HONOURED))
    no_effect = CHAT_NO_EFFECT if chat else COMPLETIONS_NO_EFFECT
    neutral = CHAT_NEUTRAL if chat else COMPLETIONS_NEUTRAL
    refused = CHAT_REFUSED if chat else COMPLETIONS_REFUSED
    if not chat:
        honoured = (*honoured, "best_of")
    bad: dict[str, list[str]] = {}
    for key, value in given.items():
        if key in refused:
            bad.setdefault(refused[key], []).append(key)
        elif key in neutral and value != neutral[key][0]:
            why = f"only {neutral[key][1]} is accepted"
            bad.setdefault(why, []).append(f"{key}={_short(value)}")
        elif key not in honoured and key not in no_effect and key not in neutral:
            bad.setdefault(f"not a field of {url} that batchgen knows", []).append(key)
    if "response_format" in given and given["response_format"] != {"type": "text"}:
        kind = given["response_format"]
        kind = kind.get("type") if isinstance(kind, dict) else kind
        bad.setdefault(f"response_format type {_short(kind)}; only 'text' for now", []).append(
            "response_format"
        )
    if not chat and given.get("best_of", given.get("n", 1)) != given.get("n", 1):
        bad.setdefault("best_of other than n", []).append("best_of")
    if bad:
        raise PromptError(
            "unsupported_field",
            "; ".join(str(unsupported(fields, why)) for why, fields in bad.items()),
        )
    params = {SAMPLING_FIELDS[k]: v for k, v in given.items() if k in SAMPLING_FIELDS}
    if chat:
        _chat_params(given, params)
        return OpenAIRequest(True, _messages(given.get("messages")), None, params)
    _completion_logprobs(given, params)
    return OpenAIRequest(False, None, _prompt(given.get("prompt")), params)


def _short(value: Any) -> str:
    """A value as the JSON it came from, cut to 40 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_params(given: dict[str, Any], params: dict[str, Any]) -> None:
    if "max_completion_tokens" in given:
        both = "max_tokens" in given and given["max_tokens"] != given["max_completion_tokens"]
        if both:
            raise PromptError(
                "bad_params",
                "body.max_completion_tokens and body.max_tokens differ; give one of them",
            )
        params["max_tokens"] = given["max_completion_tokens"]
    logprobs, top = given.get("logprobs", False), given.get("top_logprobs")
    if not isinstance(logprobs, bool):
        raise PromptError("bad_params", f"body.logprobs={_short(logprobs)}: must be true or false")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise PromptError(
            "bad_params",
            f"body.top_logprobs={_short(top)}: must be an integer in [0, {MAX_TOP_LOGPROBS}]",
        )
    if top is not None and not logprobs:
        raise PromptError("bad_params", "body.top_logprobs needs body.logprobs: true")
    if logprobs:
        params["logprobs"] = top or 0


def _completion_logprobs(given: dict[str, Any], params: dict[str, Any]) -> None:
    if "logprobs" not in given:
        return
    k = given["logprobs"]
    if not _is_int(k) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise PromptError(
            "bad_params",
            f"body.logprobs={_short(k)}: must be an integer in [0, {MAX_TOP_LOGPROBS}] "
            "(the number of top log-probs per token)",
        )
    params["logprobs"] = k


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # the engine's id checks name a bad id (true, -4, out of vocab)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise unsupported(["prompt"], "several prompts in one request; give each its own line")
    raise PromptError("bad_params", "body.prompt must be a string or a list of token ids")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Messages for the chat template: text content parts joined, `developer` as `system`."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("bad_params", "body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise PromptError("bad_params", f"body.{where} must be an object")
        extra = [f"{where}.{k}" for k in m if k not in MESSAGE_KEYS and m[k] is not None]
        if extra:
            raise unsupported(extra, "tool calls, audio and refusals are not supported")
        role = m.get("role")
        if role not in ROLES:
            if role in ("tool", "function"):
                raise unsupported([f"{where}.role"], f"{role} messages (tool calling)")
            raise PromptError(
                "bad_params", f"body.{where}.role={_short(role)}: must be one of {', '.join(ROLES)}"
            )
        message = {"role": "system" if role == "developer" else role}
        message["content"] = _content(m.get("content"), where)
        if m.get("name") is not None:
            message["name"] = m["name"]
        out.append(message)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise unsupported(
                    [f"{where}.content[{j}]"], f"content parts of type {_short(kind)}; text only"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise PromptError(
        "bad_params", f"body.{where}.content must be a string or a list of text parts"
    )
