"""Checks a generation request must pass before the engine queues it, from config.json alone.

The engine runs them in add_request (a bad request fails alone, the batch goes on) and the
planner runs the same functions on every row, in `batchgen run` and in `batchgen validate`.
So validate, which loads no weights, reports the row errors a run would end with, under the
same codes and messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from batchgen.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    """What requests are checked against: the model's config and the engine options.

    Args:
        max_model_len: longest prompt + output a request may have.
        vocab_size: token ids must lie in [0, vocab_size); None leaves ids unchecked (a
            stand-in engine without a vocabulary).
    """

    max_model_len: int
    vocab_size: int | None = None

    @classmethod
    def of(
        cls, max_position_embeddings: int, vocab_size: int, max_model_len: int | None
    ) -> ModelLimits:
        """The model's limits under the engine option max_model_len (None: the model's own)."""
        limit = min(max_model_len or max_position_embeddings, max_position_embeddings)
        return cls(limit, vocab_size)


class RequestError(NamedTuple):
    """Why a request cannot be served: a stable code, a message, and the SamplingParams field
    at fault (None when the prompt is), so a caller can say where that field was set."""

    code: str
    message: str
    field: str | None = None


def check_token_ids(ids: Iterable, vocab_size: int | None, what: str) -> RequestError | None:
    """invalid_token_id if any id is not an integer in [0, vocab_size) (a bool is no id)."""
    if vocab_size is None:
        return None
    ids = ids if isinstance(ids, (list, tuple)) else list(ids)
    # Fast path in C (type, min and max over the list): a prompt's check costs about a tenth of
    # the per-token loop below, which runs only to name the bad ids.
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return None
    bad = [
        t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
    ]
    if bad:
        return RequestError(
            "invalid_token_id", f"{what} has token id(s) outside [0, {vocab_size}): {bad[:5]}"
        )
    return None


def check_params(params: SamplingParams, limits: ModelLimits) -> RequestError | None:
    """bad_params for a field no prompt could satisfy on this model; messages start with it."""
    if params.max_tokens >= limits.max_model_len:
        # A prompt has at least one token, so every request with this max_tokens would fail.
        return RequestError(
            "bad_params",
            f"max_tokens={params.max_tokens}: must be less than max_model_len="
            f"{limits.max_model_len} (prompt + output, and a prompt has at least one token)",
            "max_tokens",
        )
    vocab = limits.vocab_size
    if vocab is None:
        return None
    # Sizes the sampler indexes the [N, V] logits with: past the vocabulary they would fail
    # the whole batch's step, so they fail this request alone.
    if params.logprobs is not None and params.logprobs > vocab:
        return RequestError(
            "bad_params", f"logprobs={params.logprobs} > vocab size {vocab}", "logprobs"
        )
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        message = f"stop_token_ids: {outside[0]} is not a token id (vocab size {vocab})"
        return RequestError("bad_params", message, "stop_token_ids")
    return None


def check_length(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int
) -> RequestError | None:
    """prompt_too_long if prompt + max_tokens exceeds max_model_len."""
    return length_error(
        describe_length(num_prompt_tokens, max_tokens),
        num_prompt_tokens + max_tokens,
        max_model_len,
        "shorten the prompt or lower max_tokens",
    )


def describe_length(num_prompt_tokens: int, max_tokens: int) -> str:
    """How long a generation request can get, as its errors quote it."""
    total = num_prompt_tokens + max_tokens
    return f"prompt has {num_prompt_tokens} tokens + max_tokens {max_tokens} = {total}"


def length_error(what: str, total: int, max_model_len: int, fix: str) -> RequestError | None:
    """prompt_too_long if a request of `total` tokens (described by `what`) exceeds
    max_model_len; `fix` says what the user can change (generation and score requests)."""
    if total <= max_model_len:
        return None
    return RequestError(
        "prompt_too_long",
        f"{what}, more than max_model_len={max_model_len}; {fix}, or raise max_model_len if "
        "the model supports it",
    )


def check_request(
    ids: list[int], params: SamplingParams, limits: ModelLimits
) -> RequestError | None:
    """Every check above, in the engine's order: prompt ids, then params, then length."""
    return (
        check_token_ids(ids, limits.vocab_size, "prompt")
        or check_params(params, limits)
        or check_length(len(ids), params.max_tokens, limits.max_model_len)
    )


def check_cache_size(num_cache_tokens: int, max_model_len: int) -> str | None:
    """Why a KV cache of this many tokens is refused at start-up (it must hold one request of
    max_model_len, or such a request could never run), or None. The model runner refuses it;
    with num_kv_blocks given, `batchgen validate` can say so before any weights load."""
    if num_cache_tokens >= max_model_len:
        return None
    return (
        f"the KV cache holds {num_cache_tokens} tokens, fewer than one max_model_len="
        f"{max_model_len} request; lower max_model_len or give the cache more memory "
        "(gpu_memory_utilization / cpu_kv_cache_gb / num_kv_blocks)"
    )
