"""SamplingParams: how one request is decoded, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchgen.short_repr import short_repr
from batchgen.structured_outputs import StructuredOutputsError, StructuredOutputsParams

# Most top log-probs a request may ask for per token (the engine also caps it at the vocab).
MAX_LOGPROBS = 100
# Range of temperature (besides 0) and repetition_penalty. The logits are divided or multiplied
# by them in float32, where 1e-300 rounds to 0 and 1e300 to inf: inf or NaN logits, and a
# garbage token that looks like a normal output. Nothing useful lies outside.
MIN_SCALE, MAX_SCALE = 1e-6, 1e6
# Most samples of one prompt. Each sample is a sequence the engine tracks (a copy of the
# prompt's ids, a slot in every step it runs) and an item of the row's output lists; a row
# asking for 100,000 by mistake would stall the run and bloat its shard. Want more? Use more rows.
MAX_N = 1024


class SamplingParamsError(ValueError):
    """A SamplingParams field has a value that cannot be used; the message names the field,
    and `field` holds its name (so a caller can say where the value was set)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings for one request.

    Args:
        max_tokens: most tokens to generate (>= 1).
        min_tokens: EOS and stop tokens are suppressed until this many tokens exist.
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0 or -1: off).
        top_p: keep the smallest set whose probability mass reaches p (1.0: off).
        min_p: drop tokens whose probability is below min_p x the top probability (0: off).
        repetition_penalty: > 1 discourages tokens already in prompt or output (1.0: off).
        presence_penalty: subtracted once from logits of tokens already generated.
        frequency_penalty: subtracted per occurrence of tokens already generated.
        seed: keys the request's random stream; None draws one when the request is added.
        n: number of independent samples of this prompt (they share the prompt's KV blocks),
            at most MAX_N.
        stop: strings that end generation; the stop string is not part of the text.
        stop_token_ids: token ids that end generation (in addition to EOS).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: if set, return the top-k log-probs of each generated token (0 <= k <=
            MAX_LOGPROBS; the sampled token's own log-prob is always included).
        structured_outputs: constrain the output to a JSON schema, any JSON object, a regex, a
            choice of strings or a grammar: a StructuredOutputsParams or a dict of its fields
            ({"json": schema}). EOS (and stop ids) are allowed only where the constraint is
            complete; an output cut by max_tokens ends with "length", incomplete.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples so the object stays hashable.
        stop = _as_tuple("stop", self.stop, "a string or a list of strings")
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids, "a list of token ids")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        if self.structured_outputs is not None:
            try:
                constraint = StructuredOutputsParams.from_value(self.structured_outputs)
            except (StructuredOutputsError, TypeError) as e:
                message = str(e).removeprefix("structured_outputs")
                raise SamplingParamsError(
                    f"SamplingParams.structured_outputs{message}", "structured_outputs"
                ) from None
            object.__setattr__(self, "structured_outputs", constraint)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> None:
            value = getattr(self, name)
            raise SamplingParamsError(f"SamplingParams.{name}={short_repr(value)}: {msg}", name)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            # finite: NaN passes no comparison and would slip through every range check below
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not is_num(self.temperature) or (
            self.temperature != 0 and not MIN_SCALE <= self.temperature <= MAX_SCALE
        ):
            bad("temperature", f"must be 0 (greedy) or a number in [{MIN_SCALE:g}, {MAX_SCALE:g}]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 = off)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or not (
            MIN_SCALE <= self.repetition_penalty <= MAX_SCALE
        ):
            bad("repetition_penalty", f"must be in [{MIN_SCALE:g}, {MAX_SCALE:g}] (1.0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                bad(name, "must be a number in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            bad("seed", "must be a non-negative integer or None")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}] (for more samples, use more rows)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        if self.structured_outputs is not None:
            if self.ignore_eos:
                bad(
                    "ignore_eos",
                    "cannot be set with structured_outputs (the output ends where "
                    "the constraint is complete)",
                )
            if self.min_tokens:
                bad(
                    "min_tokens",
                    "cannot be set with structured_outputs (EOS held back past "
                    "the end of the constraint would leave no token to draw)",
                )
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalty set (they read the token history)."""
        return self.repetition_penalty != 1.0 or bool(
            self.presence_penalty or self.frequency_penalty
        )


def _as_tuple(name: str, value: object, expected: str) -> tuple:
    """stop / stop_token_ids as a tuple: None is empty, a lone string is one stop string; the
    items themselves are checked by _validate."""
    if value is None:
        return ()
    if isinstance(value, str) and name == "stop":
        return (value,)
    if not isinstance(value, (str, bytes, dict)):
        try:
            return tuple(value)
        except TypeError:
            pass
    raise SamplingParamsError(
        f"SamplingParams.{name}={short_repr(value)}: must be {expected}", name
    )
