"""SequenceMatcher: one sequence's place in its grammar, kept in step with its known tokens."""

from __future__ import annotations

import llguidance

from batchgen.engine.sequence import Sequence


class SequenceMatcher:
    """An llguidance matcher plus the number of the sequence's output tokens it has consumed.

    The engine's token list is the truth: `sync` consumes the output tokens that became known
    since the last call and rolls back any the list no longer holds (tokens are kept through a
    preemption by recompute, so that is only a guard). Placeholders of tokens still on the
    device (async scheduling) are never consumed: a step's mask is filled after the tokens it
    depends on are read. A final EOS is not consumed either: it ends the sequence, and the
    matcher keeps no history of it (a rollback would remove the token before it).

    Args:
        matcher: a fresh matcher (CompiledGrammar.matcher()).
        eos_token_ids: the engine's EOS ids.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.num_consumed = 0

    def sync(self, seq: Sequence) -> str | None:
        """Consume seq's newly known output tokens; an error message if the grammar refuses one
        (the matcher is then in error for good), else None."""
        start = seq.num_prompt_tokens
        end = seq.num_known_tokens
        if end > start and seq.token_ids[end - 1] in self.eos_token_ids:
            end -= 1
        known = end - start
        if known < self.num_consumed:
            self.matcher.rollback(self.num_consumed - known)
        elif known > self.num_consumed:
            new = seq.token_ids[start + self.num_consumed : end]
            if not self.matcher.consume_tokens(new):
                self.num_consumed = known
                return self.matcher.get_error() or f"the grammar refused token(s) {new[:8]}"
        self.num_consumed = known
        return None

    def complete(self, seq: Sequence) -> bool:
        """Whether seq's output (less a final EOS) satisfies the grammar: False for an output
        cut short by max_tokens or a stop string."""
        return self.sync(seq) is None and self.matcher.is_accepting()
