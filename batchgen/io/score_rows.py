"""Score mode's output record: one row per candidate (or per unreadable input row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScoreRow:
    """The score of one candidate, or the error that stopped it from being scored.

    `index` is the input unit's index (a row, or a group in the group layout), deciding the
    shard; `candidate_index` is None only for a unit whose candidates could not be read.
    """

    index: int
    id: str | None
    candidate_index: int | None = None
    candidate: str | None = None
    passthrough: dict[str, Any] = field(default_factory=dict)
    score: float | None = None  # sum of the candidate tokens' log-probs
    num_tokens: int | None = None
    mean: float | None = None
    rank: int | None = None  # 1 = highest score among the unit's scored candidates
    greedy_match: bool | None = None
    token_logprobs: list[float] | None = None
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error_code is None
