"""SchedulerOutput: what one engine step computes, as decided by the Scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from batchgen.engine.sequence import Sequence


class ScheduledSequence(NamedTuple):
    """One sequence's work in a step: compute seq.token_ids[start : start + num_new_tokens].

    start is seq.num_computed_tokens at schedule time. samples is True when the chunk reaches
    the end of the sequence's tokens and it is a generation sequence: the runner samples one
    token from the logits of its last position.
    """

    seq: Sequence
    num_new_tokens: int
    start: int
    samples: bool


@dataclass
class SchedulerOutput:
    """The step's batch (running sequences first, then new admissions, in order)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Sequences that lost their KV this step and went back to waiting (to be recomputed);
    # the engine must drop any per-position state it accumulated for them (e.g. score sums).
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
