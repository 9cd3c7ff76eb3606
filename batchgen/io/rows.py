"""Row records flowing through the pipeline: one input row in, one result row out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class InputRow:
    """One input row, or the error that stopped it from being read.

    `index` is the row's position in the whole input (file order, then row order); it decides
    the row's shard. `data` holds the columns the job reads (None when the row is unreadable).
    """

    index: int
    id: str | None
    data: dict[str, Any] | None
    source: str  # "file:line" for messages
    error_code: str | None = None
    error: str | None = None


@dataclass
class ResultRow:
    """One output row: a generation result or an error record for one input row."""

    index: int
    id: str | None
    passthrough: dict[str, Any] = field(default_factory=dict)
    text: str | list[str] | None = None
    finish_reason: str | list[str] = "error"
    error: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int | list[int] = 0
    num_cached_tokens: int = 0
    chat: bool = False  # the prompt was a chat conversation (OpenAI-batch output style)
    # OpenAI-batch output only: each sample's `choices[i].logprobs` object (a list for n > 1),
    # when the request asked for log-probs.
    logprobs: Any = None
    # Structured output: the text falls short of its constraint (None: unconstrained row).
    incomplete: bool | None | list[bool | None] = None

    @classmethod
    def failed(cls, row: InputRow, code: str, message: str, passthrough=None, num_prompt_tokens=0):
        return cls(
            index=row.index,
            id=row.id,
            passthrough=passthrough or {},
            error=f"{row.source}: {message}",
            error_code=code,
            num_prompt_tokens=num_prompt_tokens,
        )

    @property
    def ok(self) -> bool:
        return self.error_code is None
