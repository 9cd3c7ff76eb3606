"""PromptAllowance: how many prompt tokens a decode step carries (mixed chunks).

A decode step of a large model is bound by reading the weights; its tensor cores idle. With
`mixed_chunk_tokens` = P, prompts are admitted longest max_tokens first and their prefill rides
in decode steps, at most P tokens of at most MIXED_CHUNK_SEQS prompts a step, as one CUDA graph
per decode bucket (MixedGraphs). A prompt is *due* when admitting it any later would make it end
after the longest running sequence: due prompts are prefilled at once, whatever P allows.
"""

from __future__ import annotations

from batchgen.engine.sequence import Sequence

# Most prompts one mixed chunk spans (the mixed graphs' prefill attention has this many rows of
# metadata). Prompts longer than P take several steps; short ones share a chunk.
MIXED_CHUNK_SEQS = 4

# A deferred prompt becomes due this many steps before deferring it any longer would make it end
# after the longest running sequence (its own prefill takes a few steps).
DUE_SLACK_STEPS = 16

# Once a prompt is due, the step runs eagerly anyway (more than P prompt tokens): prompts that
# would fall due within this many more steps are prefilled in the same step. Each eager step
# costs the host about 30 ms of launches (llama3.1-8b), more than a small one's GPU time, so
# fewer, larger eager steps leave the GPU idle less.
DUE_LOOKAHEAD_STEPS = 16

# mixed_chunk_tokens=None: P for models with at least AUTO_MIN_PARAMS parameters, off below. On
# the H100, nano gained 6% on llama3.1-8b with P=128 (64-256 tried) and lost 3% on qwen3-0.6b,
# whose prefill is too cheap to be worth hiding.
AUTO_CHUNK_TOKENS = 128
AUTO_MIN_PARAMS = 4_000_000_000


def auto_chunk_tokens(num_params: int, max_num_batched_tokens: int) -> int:
    """mixed_chunk_tokens for a model of num_params parameters when the option is None."""
    if num_params < AUTO_MIN_PARAMS:
        return 0
    return min(AUTO_CHUNK_TOKENS, max_num_batched_tokens)


def remaining_steps(seq: Sequence) -> int:
    """Decode steps seq may still take (its max_tokens not yet generated)."""
    return seq.params.max_tokens - seq.num_output_tokens


def admission_order(seq: Sequence) -> tuple[bool, int]:
    """Sort key of the waiting queue with mixed chunks on: preempted sequences first, then the
    longest remaining max_tokens (a stable sort keeps submission order among equals, so samples
    follow their parent and prompts sharing a prefix stay together)."""
    return (seq.num_preemptions == 0, 0 if seq.is_score else -remaining_steps(seq))


class PromptAllowance:
    """Prompt tokens that one step with decode rows may still give prompts that are not due.

    Args:
        tokens: P, the step's prompt tokens for prompts that are not due.
        horizon: the longest running sequence's remaining steps.
        most_remaining: the largest remaining max_tokens among prompts still to prefill
            (waiting, or running mid-prompt); when that prompt is due, so are those due within
            DUE_LOOKAHEAD_STEPS more steps.
    """

    def __init__(self, tokens: int, horizon: int, most_remaining: int | None = None) -> None:
        self.left = tokens
        self.seqs_left = MIXED_CHUNK_SEQS
        self.horizon = horizon
        self.slack = DUE_SLACK_STEPS
        if most_remaining is not None and self._due(most_remaining):
            self.slack += DUE_LOOKAHEAD_STEPS

    def _due(self, remaining: int) -> bool:
        """Whether a prompt with `remaining` steps of max_tokens left is due at this slack."""
        return remaining + self.slack >= self.horizon

    def is_due(self, seq: Sequence) -> bool:
        """Preempted and scoring sequences are always due (nothing to align them with)."""
        if seq.is_score or seq.num_preemptions:
            return True
        return self._due(remaining_steps(seq))

    def exhausted(self) -> bool:
        """No prompt that is not due gets tokens in this step any more."""
        return not self.left or not self.seqs_left

    def peek(self, seq: Sequence, wanted: int) -> int:
        """Tokens of `wanted` this step may give seq."""
        if self.is_due(seq):
            return wanted
        return 0 if self.exhausted() else min(wanted, self.left)

    def take(self, seq: Sequence, num: int) -> None:
        """Charge num tokens given to seq (num <= peek(seq, ...))."""
        if num and not self.is_due(seq):
            self.left -= num
            self.seqs_left -= 1
