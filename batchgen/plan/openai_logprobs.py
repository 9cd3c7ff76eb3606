"""Generated tokens' log-probs in the OpenAI response shapes (chat and legacy completions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TokenBytes = Callable[[int], bytes]


def token_text(raw: bytes) -> str:
    """A token as text; one that holds part of a UTF-8 character is written as OpenAI does,
    `bytes:\\xNN...` (its exact bytes are in the `bytes` field)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _ranked(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine returns the top k plus the sampled token when that is not among them.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, token_bytes: TokenBytes
) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}] * k}] per generated token, "refusal": null}."""

    def item(tid: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(tid)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    content = []
    for tid, entry in zip(token_ids, logprobs):
        top = [item(t, lp) for t, lp in _ranked(entry, k)]
        content.append({**item(tid, entry[tid]), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, token_bytes: TokenBytes
) -> dict[str, Any]:
    """`choices[i].logprobs` of a text completion: {tokens, token_logprobs, top_logprobs (one
    {token: logprob} per position: the top k and the sampled token), text_offset (character
    offset of each token in the completion text)}."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for tid, entry in zip(token_ids, logprobs):
        text = token_text(token_bytes(tid))
        tokens.append(text)
        token_logprobs.append(entry[tid])
        top = {token_text(token_bytes(t)): lp for t, lp in _ranked(entry, k)}
        top.setdefault(text, entry[tid])
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
