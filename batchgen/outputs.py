"""Result records returned by the engine and the LLM API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sample of a request (a request with n > 1 has n of these)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    # Per generated token: {token_id: logprob}, the sampled token always included.
    logprobs: list[dict[int, float]] | None = None
    # Structured output only (else None): True when the text falls short of the constraint
    # (cut by max_tokens, finish_reason "length", or by a stop string).
    incomplete: bool | None = None


@dataclass
class RequestOutput:
    """The finished result of one request; `text`/`token_ids`/`finish_reason` are sample 0's.

    A request that could not be served has finish_reason "error", a stable `error_code`
    (e.g. "prompt_too_long") and a human-readable `error`; other requests are unaffected.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None
    num_cached_tokens: int = 0
    # Score requests only: one entry per candidate, in candidate order.
    scores: list[ScoreOutput] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str:
        if self.error is not None:
            return "error"
        return self.outputs[0].finish_reason if self.outputs else "error"

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs if self.outputs else None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @classmethod
    def failed(cls, request_id: str, prompt_token_ids: list[int], code: str, message: str):
        return cls(request_id, list(prompt_token_ids), [], error=message, error_code=code)


@dataclass
class ScoreOutput:
    """Log-likelihood of one candidate continuation after its prompt."""

    score: float  # sum of log-probs of the candidate tokens
    num_tokens: int
    mean: float
    token_logprobs: list[float] | None = None
    greedy_match: bool | None = None
    error: str | None = None
    error_code: str | None = None
