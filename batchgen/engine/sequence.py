"""Sequence: one generation sample or one scored candidate, and its progress through the engine."""

from __future__ import annotations

import enum

from batchgen.sampling_params import SamplingParams

# Stands in token_ids for a token sampled by a step still running on the device (async
# scheduling): the next step reads it from the device, the engine writes it in on resolve.
# Only the last one or two tokens of a sequence can be pending.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """The token list of one sample plus the scheduler's and block manager's view of it.

    Args:
        seq_id: unique id within the engine (keys the sampled-token dict).
        request_id: id of the request this sample belongs to.
        prompt_token_ids: the prompt (for a scoring sequence: prompt + candidate tokens).
        params: decoding settings; a scoring sequence ignores them.
        sample_index: which of the request's n samples this is.
        seed: seed of this sample's random stream.
        score_from: None for generation; for scoring, the index of the first candidate token.
            The sequence then needs logits at positions score_from-1 .. num_tokens-2, never
            samples, and finishes with reason "score" once all its tokens are computed.
        parent: for sample k > 0 of an n > 1 request, sample 0; this sequence then waits
            until the parent has computed its prompt and shares the parent's prompt blocks.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        sample_index: int = 0,
        seed: int = 0,
        score_from: int | None = None,
        parent: Sequence | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id} (request {request_id!r}): empty prompt")
        if score_from is not None and not 1 <= score_from < len(prompt_token_ids):
            raise ValueError(
                f"sequence {seq_id} (request {request_id!r}): score_from={score_from} must be "
                f"in [1, {len(prompt_token_ids) - 1}] (a non-empty candidate after a non-empty "
                "prompt)"
            )
        if parent is not None and score_from is not None:
            raise ValueError(f"sequence {seq_id}: a scoring sequence cannot have a parent")
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.seed = seed
        self.score_from = score_from
        self.parent = parent
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # Tokens whose KV is in the cache; the runner computes token_ids[num_computed_tokens:].
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache or a fork at first admission; never reset.
        self.num_cached_tokens = 0
        # Times this sequence was preempted (its KV dropped, to be recomputed).
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "score"
        # Launched steps that computed part of this sequence and are not resolved yet; its
        # request is returned only once every sequence is finished and settled (0).
        self.num_inflight = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens whose ids are on the host (all but the trailing pending ones)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] == PENDING_TOKEN:
            n -= 1
        return n

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_score(self) -> bool:
        return self.score_from is not None

    @property
    def max_output_tokens(self) -> int:
        """Most tokens this sequence may generate: params.max_tokens, or 0 when scoring."""
        return 0 if self.is_score else self.params.max_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Most tokens whose KV this sequence ever holds (the last sampled token never gets KV)."""
        if self.is_score:
            return self.num_prompt_tokens
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold the KV of all current tokens."""
        return -(-self.num_tokens // block_size)

    def append_token(self, token_id: int) -> None:
        assert not self.is_score, f"sequence {self.seq_id} is a scoring sequence; it never samples"
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
