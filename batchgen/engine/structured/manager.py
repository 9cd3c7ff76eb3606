"""StructuredOutputs: the engine's structured-output state across steps."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance
import torch

from batchgen.engine.request import Request
from batchgen.engine.sequence import Sequence
from batchgen.engine.structured.bitmask import BitmaskFiller
from batchgen.engine.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from batchgen.engine.structured.matcher import SequenceMatcher
from batchgen.structured_outputs import StructuredOutputsParams


class StructuredOutputs:
    """Compiles constraints off the step path and keeps one matcher per constrained sequence.

    A constraint already compiled (the job's one schema, or a row's that the planner compiled
    while planning its shard) is used at once; a new one compiles on a worker thread, and its
    request joins the scheduler when it is ready, so a step never waits on a compile. Each
    sample of an n > 1 request gets its own matcher.

    Args:
        compiler: the GrammarCompiler for the engine's tokenizer and vocabulary.
        eos_token_ids: the engine's EOS ids (a constrained sequence ends with one).
        num_threads: mask threads (BitmaskFiller); None: llguidance's default.
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        eos_token_ids: frozenset[int],
        num_threads: int | None = None,
    ) -> None:
        self.compiler = compiler
        self.eos_token_ids = eos_token_ids
        self.filler = BitmaskFiller(compiler.vocab_size, num_threads)
        self._matchers: dict[int, SequenceMatcher] = {}  # seq_id -> matcher
        self._worker: ThreadPoolExecutor | None = None
        self._compiling: list[tuple[Future, Request]] = []  # requests held for their grammar
        # Host time spent in `fill` (syncing matchers and computing masks), for benchmarks.
        self.fill_seconds = 0.0
        self.rows_filled = 0
        self.steps_filled = 0

    @property
    def words(self) -> int:
        """int32 words of one mask row."""
        return self.filler.words

    def prepare(self, constraint: StructuredOutputsParams) -> CompiledGrammar | Future:
        """The compiled constraint when cached (GrammarError if it was refused), else a Future
        of it compiling on the worker thread."""
        compiled = self.compiler.cached(constraint)
        if compiled is not None:
            return compiled
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._worker.submit(self.compiler.compile, constraint)

    def hold(self, future: Future, request: Request) -> None:
        """Keep a request out of the scheduler until its constraint has compiled."""
        self._compiling.append((future, request))

    @property
    def num_held(self) -> int:
        return len(self._compiling)

    def ready(self, block: bool) -> list[tuple[Request, GrammarError | None]]:
        """Held requests whose constraint is done compiling, each with its refusal or None
        (then its matchers are added); block: wait for at least one first."""
        if not self._compiling:
            return []
        if block:
            wait([f for f, _ in self._compiling], return_when=FIRST_COMPLETED)
        finished = [f.done() for f, _ in self._compiling]  # read once: a race would drop one
        done = [item for item, ok in zip(self._compiling, finished) if ok]
        self._compiling = [item for item, ok in zip(self._compiling, finished) if not ok]
        out: list[tuple[Request, GrammarError | None]] = []
        for future, request in done:
            try:
                self.add(request.seqs, future.result())
            except GrammarError as e:
                out.append((request, e))
                continue
            out.append((request, None))
        return out

    def add(self, seqs: list[Sequence], compiled: CompiledGrammar) -> None:
        """A matcher in the start state for each of a request's sequences."""
        for seq in seqs:
            self._matchers[seq.seq_id] = SequenceMatcher(compiled.matcher(), self.eos_token_ids)

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def constrained(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matchers

    def any_constrained(self, seqs: list[Sequence]) -> bool:
        return bool(self._matchers) and any(s.seq_id in self._matchers for s in seqs)

    def fill(self, out: torch.Tensor, seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        """Masks for one step's sampling rows into out [len(seqs), words] int32 (host): each
        constrained, unfinished sequence's matcher first consumes its tokens known since the
        last step; once its grammar is complete its mask allows EOS alone. Rows of other
        sequences and of finished ones (their token will be dropped) allow every token.
        Returns (sequence, message) for each matcher that refused a token (its row allows
        every token too; the caller fails its request)."""
        start = time.perf_counter()
        rows: list[llguidance.LLMatcher | None] = []
        errors: list[tuple[Sequence, str]] = []
        for seq in seqs:
            state = self._matchers.get(seq.seq_id)
            if state is None:
                rows.append(None)
                continue
            error = state.sync(seq)
            if error is not None:
                errors.append((seq, error))
                rows.append(None)
            else:
                rows.append(state.matcher)
        self.filler.fill(out, rows)
        self.fill_seconds += time.perf_counter() - start
        self.rows_filled += sum(r is not None for r in rows)
        self.steps_filled += 1
        return errors

    def finish(self, request: Request) -> dict[int, bool | None]:
        """Per sample of a finished request, whether its output falls short of its constraint
        (None where unconstrained); the request's matchers are released."""
        flags = {}
        for seq in request.seqs:
            state = self._matchers.pop(seq.seq_id, None)
            flags[seq.seq_id] = None if state is None else not state.complete(seq)
        return flags

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
