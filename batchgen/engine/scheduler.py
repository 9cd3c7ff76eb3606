"""Scheduler: continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.prompt_allowance import PromptAllowance, admission_order, remaining_steps
from batchgen.engine.request_checks import check_length, describe_length, length_error
from batchgen.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from batchgen.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus


class AddError(NamedTuple):
    """Why a sequence can never be served: a stable code and a message saying what to change."""

    code: str  # "prompt_too_long" | "cannot_fit"
    message: str


# Admission keeps free the blocks running sequences will grow into (their remaining prompt
# chunks and max_tokens), up to this fraction of the cache: a long-context batch then finishes
# its decodes without preempting (and recomputing) the prompts admitted last.
GROWTH_RESERVE_FRACTION = 0.1


def _batch_order(item: ScheduledSequence) -> tuple[bool, int]:
    return (item.num_new_tokens != 1, -item.start if item.num_new_tokens == 1 else 0)


class Scheduler:
    """Decides, step by step, which sequences compute how many tokens under one token budget.

    Each step first serves running sequences, oldest admission first (a decode token or the
    next prefill chunk), preempting the newest running sequences when KV blocks run out; then
    admits waiting sequences in FIFO order while the budget, max_num_seqs and the free blocks
    allow, keeping back the blocks that running sequences will grow into (up to
    GROWTH_RESERVE_FRACTION of the cache). Samples 1..n-1 of a request wait for sample 0 to
    compute its prompt and then share its prompt blocks.

    Once admission has stopped for want of room (max_num_seqs or blocks) with prompts still
    waiting, it is tried again, while sequences run, only after admission_interval steps or
    once admission_batch sequences have finished: the prompts that the finished sequences make
    room for are then admitted together, in one mixed step, instead of one eager (not
    graph-replayed) mixed step per finished sequence.

    With mixed_chunk_tokens = P > 0, prompts ride in decode steps instead (PromptAllowance):
    waiting sequences are admitted longest remaining max_tokens first, and a step with decode
    rows gives at most P tokens to at most MIXED_CHUNK_SEQS prompts that are not due; due
    prompts (admitting them later would lengthen the batch's tail) take the whole budget.
    `mixed_chunk_room` adds the tokens a step's padding decode rows can carry (see Args).

    Args:
        block_manager: the KV block pool.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: longest sequence (prompt + output) allowed.
        eos_token_ids: tokens that end generation (unless params.ignore_eos).
        admission_interval: steps between admission attempts while the batch is full; 1 tries
            every step.
        admission_batch: finished sequences that end the wait early (a burst of sequences
            ending together is refilled at once); None takes max_num_seqs // 16, at least 1.
        mixed_chunk_tokens: 0 (off), or P: the prompt tokens a decode step carries.
        mixed_chunk_room: d -> prompt tokens a step with d decode rows may carry beyond P
            (the runner's: its mixed CUDA graph pads d up to a bucket, and prompt tokens ride
            in those padding rows); None: none.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        admission_interval: int = 1,
        admission_batch: int | None = None,
        mixed_chunk_tokens: int = 0,
        mixed_chunk_room: Callable[[int], int] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.mixed_chunk_tokens = mixed_chunk_tokens
        self.mixed_chunk_room = mixed_chunk_room
        self._waiting_unsorted = False  # mixed chunks: re-sort the queue before admitting
        self.admission_interval = admission_interval
        self.admission_batch = admission_batch or max(1, max_num_seqs // 16)
        # Since admission last stopped for want of room: steps, and running sequences that
        # finished (steps None: it did not stop for room).
        self._steps_since_full: int | None = None
        self._finished_since_full = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    # ---- queue state -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- requests in and out -----------------------------------------------------------------
    def add(self, seq: Sequence) -> AddError | None:
        """Queue seq (FIFO), or return why it can never be served.

        A rejected sequence is marked FINISHED (finish_reason stays None) and never queued, so
        siblings naming it as parent fall back to normal admission instead of waiting for it.
        """
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        error = self.check_servable(seq)
        if error is not None:
            seq.status = SequenceStatus.FINISHED
            return error
        self.waiting.append(seq)
        self._waiting_unsorted = True
        return None

    def check_servable(self, seq: Sequence) -> AddError | None:
        # The generation length check is the planner's too (request_checks), so `batchgen
        # validate` predicts it; the score planner checks prompt + candidate before this.
        if seq.is_score:
            what = f"prompt + candidate has {seq.num_tokens} tokens"
            error = length_error(what, seq.num_tokens, self.max_model_len, "shorten the input")
        else:
            n, m = seq.num_prompt_tokens, seq.params.max_tokens
            what = None  # worded only for the error below (check_length words its own)
            error = check_length(n, m, self.max_model_len)
        if error is not None:
            return AddError(error.code, error.message)
        bm = self.block_manager
        if not bm.can_ever_fit(seq.max_kv_tokens):
            what = what or describe_length(n, m)
            needed = -(-seq.max_kv_tokens // bm.block_size)
            return AddError(
                "cannot_fit",
                f"{what}; its KV needs {needed} blocks of {bm.block_size} tokens but the cache "
                f"has only {bm.num_blocks}; raise num_kv_blocks (or the memory given to the KV "
                "cache)" + ("" if seq.is_score else " or lower max_tokens"),
            )
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq now (stop string found, or abort): free its blocks, drop it from the queues."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._finished_since_full += 1
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.parent = None
        self.block_manager.free(seq)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first, then admissions (see the class)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        allowance = self._prompt_allowance()
        self._schedule_running(out, budget, allowance)
        budget -= out.num_batched_tokens
        # After a preemption, blocks are short: admitting now would only thrash.
        if out.preempted:
            self._mark_full(True)
        elif self._admission_due():
            pending = self._prefixes_in_prefill()
            self._mark_full(self._schedule_waiting(out, budget, pending, allowance))
        assert out.scheduled or not self.has_unfinished(), (
            "scheduler stalled with nothing running: add() should have rejected "
            f"{self.waiting[0] if self.waiting else None}"
        )
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        assert len(out.scheduled) <= self.max_num_seqs
        # Single-token rows first, attention runs them through the decode kernel; longest
        # context first among them, so its work queue starts with the biggest units and
        # finishes evenly (ragged lengths otherwise leave a long sequence running alone).
        out.scheduled.sort(key=_batch_order)
        return out

    def _prompt_allowance(self) -> PromptAllowance | None:
        """With mixed chunks on and sequences decoding: what this step may give prompts that
        are not due. None when prompts take the whole token budget."""
        if not self.mixed_chunk_tokens:
            return None
        horizon = 0
        decoding = 0  # decode rows of this step (running sequences with one token to compute)
        most = None  # the largest remaining max_tokens of a prompt still to prefill
        for seq in self.running:
            left = seq.num_tokens - seq.num_computed_tokens
            decoding += left == 1
            if not seq.is_score:
                horizon = max(horizon, remaining_steps(seq))
                if left > 1:
                    most = max(most or 0, remaining_steps(seq))
        if not decoding:
            return None  # nothing to ride along with: fill the step
        for seq in self.waiting:
            if not seq.is_score and not seq.num_preemptions:
                most = max(most or 0, remaining_steps(seq))
        tokens = self.mixed_chunk_tokens
        if self.mixed_chunk_room is not None:
            tokens += self.mixed_chunk_room(decoding)
        return PromptAllowance(tokens, horizon, most)

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, allowance: PromptAllowance | None = None
    ) -> None:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"running {seq} has nothing to compute"
            if allowance is not None and num_new > 1:  # a prompt chunk
                num_new = allowance.peek(seq, num_new)
                if not num_new:
                    i += 1
                    continue
                allowance.take(seq, num_new)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # newest admission; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return
            self._add_scheduled(out, seq, num_new)
            budget -= num_new
            i += 1

    def _mark_full(self, full: bool) -> None:
        """Start (full) or end the wait for room that _admission_due measures."""
        self._steps_since_full = 0 if full else None
        self._finished_since_full = 0

    def _admission_due(self) -> bool:
        """Whether this step tries to admit: always while nothing runs or admission last
        stopped for another reason than room; else after admission_interval steps, or once
        admission_batch running sequences have finished."""
        if self._steps_since_full is None or not self.running:
            return True
        self._steps_since_full += 1
        return (
            self._steps_since_full >= self.admission_interval
            or self._finished_since_full >= self.admission_batch
        )

    def _schedule_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        pending: set[tuple[int, ...]],
        allowance: PromptAllowance | None = None,
    ) -> bool:
        """Admit waiting sequences FIFO (with mixed chunks: preempted first, then longest
        remaining max_tokens); return whether admission stopped for want of room (max_num_seqs
        or KV blocks) with sequences still waiting.

        `pending` holds prefixes whose last block is being computed (by running prefills, then
        by this step's admissions too). A waiting sequence whose next uncached block ends one of
        them waits and later hits the cache, instead of computing the same prefix alongside
        (shared system prompts, few-shot headers, the candidates of one scored prompt).
        """
        bm = self.block_manager
        skipped: list[Sequence] = []  # siblings awaiting their parent; sequences deferred
        cap = int(GROWTH_RESERVE_FRACTION * bm.num_blocks)
        reserve = min(sum(self._growth_blocks(seq) for seq in self.running), cap)
        if self.mixed_chunk_tokens and self._waiting_unsorted:
            self.waiting = deque(sorted(self.waiting, key=admission_order))
            self._waiting_unsorted = False
        full = False
        while self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                full = True
                break
            seq = self.waiting[0]
            if allowance is not None and allowance.exhausted() and not allowance.is_due(seq):
                break  # the queue is sorted: no later sequence is due either
            computed = self._reusable_blocks(seq)
            if computed is None:
                skipped.append(self.waiting.popleft())
                continue
            next_prefix = self._next_uncached_prefix(seq, len(computed))
            if next_prefix is not None and next_prefix in pending:
                skipped.append(self.waiting.popleft())
                continue
            num_computed = len(computed) * bm.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if allowance is not None:  # never 0: past exhaustion only due sequences get here
                num_new = allowance.peek(seq, num_new)
            if not bm.allocate_slots(seq, num_new, computed, reserve=reserve):
                full = True
                break  # no head-of-line skipping: wait for blocks to free up
            if allowance is not None:
                allowance.take(seq, num_new)
            reserve = min(reserve + self._growth_blocks(seq), cap)
            self.waiting.popleft()
            if next_prefix is not None:
                pending.add(next_prefix)
            seq.parent = None
            if seq.num_preemptions == 0:  # first admission
                seq.num_cached_tokens = num_computed
                bm.record_cache_query(seq.num_prompt_tokens, num_computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_scheduled(out, seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return full

    def _growth_blocks(self, seq: Sequence) -> int:
        """Blocks seq still needs beyond its table to reach its longest possible KV."""
        bs = self.block_manager.block_size
        return max(0, -(-seq.max_kv_tokens // bs) - len(seq.block_table))

    def _prefixes_in_prefill(self) -> set[tuple[int, ...]]:
        """Next-block prefixes of running sequences whose cacheable prompt is not computed yet."""
        bs = self.block_manager.block_size
        return {
            prefix
            for seq in self.running
            if (prefix := self._next_uncached_prefix(seq, seq.num_computed_tokens // bs))
            is not None
        }

    def _next_uncached_prefix(self, seq: Sequence, num_cached_blocks: int) -> tuple | None:
        """The tokens up to the end of seq's first block not found in the cache, if that block
        is full and cacheable; None otherwise (or when caching is off)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.parent is not None:
            return None
        limit = seq.score_from - 1 if seq.is_score else seq.num_tokens - 1
        end = (num_cached_blocks + 1) * bm.block_size
        return tuple(seq.token_ids[:end]) if end <= limit else None

    def _reusable_blocks(self, seq: Sequence) -> list[int] | None:
        """Blocks seq can start from on admission; None while it must wait for its parent."""
        parent = seq.parent
        if parent is not None and not parent.is_finished:
            prompt_done = parent.num_computed_tokens >= parent.num_prompt_tokens
            if parent.status is not SequenceStatus.RUNNING or not prompt_done:
                return None
            # Fork: share the parent's full prompt blocks, leaving at least the last prompt
            # token for the child to compute (its logits give the child's first sample).
            num_shared = (seq.num_prompt_tokens - 1) // self.block_manager.block_size
            return parent.block_table[:num_shared]
        if seq.is_score:
            limit = seq.score_from - 1  # logits are needed from position score_from - 1 on
        else:
            limit = seq.num_tokens - 1  # compute at least one token to get logits
        return self.block_manager.get_computed_blocks(seq, limit)

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        samples = not seq.is_score and start + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSequence(seq, num_new, start, samples))
        out.num_batched_tokens += num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._waiting_unsorted = True

    # ---- after the model ran -----------------------------------------------------------------
    @staticmethod
    def advancing(output: SchedulerOutput) -> list[Sequence]:
        """The scheduled sequences advance(output) moves on (and counts in flight): those still
        running. Call it before advance, which may finish some of them."""
        return [s.seq for s in output.scheduled if s.seq.status is SequenceStatus.RUNNING]

    def advance(self, output: SchedulerOutput) -> list[tuple[int, Sequence, int]]:
        """Account for a launched step before its sampled tokens are known (async scheduling).

        Each scheduled sequence still running advances by its computed tokens; a sampling one
        gets a PENDING_TOKEN placeholder and finishes with "length" now if that token is its
        last allowed one; a scoring one finishes with "score" once all its tokens are computed.
        Blocks holding only known tokens go into the prefix cache.

        Returns:
            (sample row, sequence, index of its placeholder in token_ids) per sampling
            sequence that advanced; resolve_token fills each placeholder in.
        """
        placeholders: list[tuple[int, Sequence, int]] = []
        row = -1
        for s in output.scheduled:
            row += s.samples
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished (stop, abort) after this step was scheduled
            seq.num_computed_tokens += s.num_new_tokens
            seq.num_inflight += 1
            self.block_manager.cache_full_blocks(seq)
            if s.samples:
                placeholders.append((row, seq, len(seq.token_ids)))
                seq.append_token(PENDING_TOKEN)
                if (
                    seq.num_output_tokens >= seq.params.max_tokens
                    or seq.num_tokens >= self.max_model_len
                ):
                    self.finish(seq, "length")
            elif seq.is_score and seq.num_computed_tokens == seq.num_tokens:
                self.finish(seq, "score")
        return placeholders

    def resolve_token(self, seq: Sequence, index: int, token: int) -> bool:
        """Write the sampled token at token_ids[index]; False when it was discarded (the
        sequence stopped at an earlier token). A stop token (EOS unless ignore_eos, or a stop
        id, once min_tokens are out) ends the sequence there, dropping any later placeholder."""
        if index >= len(seq.token_ids):
            return False
        seq.token_ids[index] = token
        params = seq.params
        num_output = index + 1 - seq.num_prompt_tokens
        if num_output >= params.min_tokens and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            self.stop_at(seq, index, "stop")
        elif seq.status is SequenceStatus.RUNNING:
            self.block_manager.cache_full_blocks(seq)
        return True

    def stop_at(self, seq: Sequence, index: int, reason: str) -> None:
        """End seq with token_ids[index] as its last token (tokens after it are dropped)."""
        del seq.token_ids[index + 1 :]
        if seq.is_finished:
            seq.finish_reason = reason  # it had ended later ("length"); this token came first
        else:
            self.finish(seq, reason)

    def postprocess(self, output: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """advance + resolve_token in one go, for a step whose tokens are already known.

        Args:
            output: this step's schedule.
            sampled: seq_id -> sampled token for every scheduled entry with samples=True.

        Returns:
            The sequences that finished this step (status FINISHED, blocks freed).
        """
        live = self.advancing(output)
        for _, seq, index in self.advance(output):
            self.resolve_token(seq, index, sampled[seq.seq_id])
        for seq in live:
            seq.num_inflight -= 1
        return [seq for seq in live if seq.is_finished]
