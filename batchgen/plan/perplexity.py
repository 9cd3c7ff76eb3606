"""Sliding-window perplexity: which tokens each window holds and which of them it scores.

The recipe is Hugging Face's "perplexity of fixed-length models" (the strided sliding window):
the text is tokenized once (with the BOS the tokenizer adds), and windows of at most `context`
tokens start every `stride` tokens, [k * stride, min(k * stride + context, N)). Each window
scores only the tokens the previous window did not reach: from the previous window's end (the
first window from token 1: token 0 has no context) to its own end, each token predicted from
the window's tokens before it. Every token 1 .. N-1 is thus scored exactly once, with at least
`context - stride` tokens of context once past the first window. The last window ends at N.

When stride == context the windows do not overlap and a window's first token has no context:
it is not scored (as in Hugging Face's recipe, whose labels shift by one inside each window).

perplexity = exp(sum of the scored tokens' negative log-likelihoods / their count), over one
text or over several texts pooled token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """Token ranges of one window: context [begin, scored_from), scored [scored_from, end)."""

    begin: int
    scored_from: int
    end: int

    @property
    def num_scored(self) -> int:
        return self.end - self.scored_from


def check_window_args(context: int, stride: int) -> None:
    """Raise ValueError naming the argument unless 1 <= stride <= context and context >= 2."""
    if context < 2:
        raise ValueError(f"context={context}: must be >= 2 tokens")
    if not 1 <= stride <= context:
        raise ValueError(f"stride={stride}: must be between 1 and context={context}")


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows of a text of num_tokens tokens (none for fewer than 2 tokens)."""
    check_window_args(context, stride)
    windows: list[Window] = []
    previous_end = 0
    for begin in range(0, max(num_tokens - 1, 0), stride):
        end = min(begin + context, num_tokens)
        scored_from = max(previous_end, begin + 1)
        if end > scored_from:
            windows.append(Window(begin, scored_from, end))
        previous_end = end
        if end == num_tokens:
            break
    return windows


@dataclass
class PerplexityOutput:
    """Perplexity of one text (or of several pooled, see `pool`).

    Attributes:
        nll: sum of the scored tokens' negative log-likelihoods (natural log).
        num_tokens: tokens scored (the text's tokens minus the first, minus each window's first
            token when stride == context).
        num_windows: windows run.
        error / error_code: why the text could not be scored (too short, a token past the
            vocabulary, a window the KV cache cannot hold); nll and num_tokens are then 0.
    """

    nll: float
    num_tokens: int
    num_windows: int
    error: str | None = None
    error_code: str | None = None

    @property
    def perplexity(self) -> float:
        """exp(nll / num_tokens); NaN when nothing was scored."""
        if self.num_tokens == 0:
            return math.nan
        return math.exp(self.nll / self.num_tokens)

    @classmethod
    def pool(cls, outputs: list[PerplexityOutput]) -> PerplexityOutput:
        """Several texts as one: their scored tokens pooled (texts with an error left out)."""
        ok = [o for o in outputs if o.error is None]
        return cls(
            sum(o.nll for o in ok), sum(o.num_tokens for o in ok), sum(o.num_windows for o in ok)
        )
