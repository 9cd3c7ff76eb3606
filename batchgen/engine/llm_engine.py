"""LLMEngine: the streaming interface — add requests, step, collect finished outputs."""

from __future__ import annotations

import itertools
import random
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen.config import EngineConfig
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.detokenizer import StopStringChecker
from batchgen.engine.gc_pause import HeapFreeze
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.penalties import History
from batchgen.engine.request import Request, ScoreAccumulator, sample_seed
from batchgen.engine.request_checks import ModelLimits, check_params, check_token_ids
from batchgen.engine.sampler import SamplingBatch
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.scheduler_output import SchedulerOutput
from batchgen.engine.sequence import Sequence
from batchgen.engine.stats import EngineStats
from batchgen.engine.step_handle import StepHandle
from batchgen.models.config import ModelConfig
from batchgen.models.tokenizer import Tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams, SamplingParamsError
from batchgen.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from batchgen.engine.structured.manager import StructuredOutputs

_SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class _Launched:
    """A step on the device: its handle, its schedule, and the placeholders advance() left
    ((sample row, sequence, index in token_ids) per sampling sequence)."""

    handle: StepHandle | None  # None until the draw is enqueued (structured output)
    output: SchedulerOutput
    placeholders: list[tuple[int, Sequence, int]]
    advanced: list[Sequence] = field(default_factory=list)  # num_inflight raised for these
    epochs: list[int] = field(default_factory=list)  # per row: seq.num_preemptions at launch


class LLMEngine:
    """Continuous-batching generator over a paged KV cache.

    Requests go in with `add_request` / `add_score_request`; each `step` runs one batch and
    returns the requests that finished in it. A request that cannot be served comes back as an
    error output from the next step; it never raises and never disturbs the others.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        # A runner over a random-weight preset (benchmarks) has no tokenizer: token ids only.
        self.tokenizer = tokenizer if tokenizer or runner else Tokenizer.from_dir(config.model)
        self.model_config = (
            runner.model_config if runner is not None else ModelConfig.from_dir(config.model)
        )
        mc = self.model_config
        self.limits = ModelLimits.of(
            mc.max_position_embeddings, mc.vocab_size, config.max_model_len
        )
        self.max_model_len = self.limits.max_model_len
        self.runner = runner or ModelRunner(config, mc, self.max_model_len)
        # Sequence ids restart with each engine: histories an earlier engine over this runner
        # left behind (it was dropped mid-run) must not pass for this one's.
        self.runner.sampler.penalties.reset()
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        self.eos_token_ids = frozenset(tokenizer_eos) | frozenset(mc.eos_token_ids)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            admission_interval=config.admission_interval,
            mixed_chunk_tokens=self.runner.mixed_chunk_tokens,
            mixed_chunk_room=self.runner.mixed_chunk_room,
        )
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._requests: dict[str, Request] = {}
        self._ready: list[RequestOutput] = []  # rejected at add time, returned by the next step
        self._inflight: _Launched | None = None  # launched, not yet resolved (async scheduling)
        # Structured output: built with the first constrained request (its tokenizer index
        # takes about a second at a 150k vocabulary); requests whose grammar compiles.
        self.structured: StructuredOutputs | None = None
        # The pre-run heap is frozen while requests are unfinished (gc_pause.py); an engine
        # dropped mid-run gives its hold back when it is collected.
        self._heap = HeapFreeze()
        weakref.finalize(self, self._heap.release)
        # calibrate_kv_scales: the first N prompts received, until the first step uses them.
        self._calibration: list[list[int]] | None = [] if config.calibrate_kv_scales else None

    # ---- FP8 KV-cache scales -------------------------------------------------------------
    def kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's (k_scale, v_scale): what an FP8 KV cache stores K and V divided by."""
        return self.runner.kv_scales.get()

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Set each layer's (k_scale, v_scale) before the engine's first step (e.g. the ones a
        calibration stored); raises ValueError for a wrong count or a value not > 0."""
        self._check_idle("set_kv_scales")
        self.runner.kv_scales.set(scales)
        self._calibration = None

    def calibrate_kv_scales(self, prompts: list[list[int]]) -> list[tuple[float, float]]:
        """Set each layer's K/V scales from max |k|, |v| over `prompts` (token ids) and return
        them (engine/kv_scales.py). Call before the engine's first step."""
        self._check_idle("calibrate_kv_scales")
        self._calibration = None
        return self.runner.kv_scales.calibrate(
            prompts, self.max_model_len, self.config.max_num_batched_tokens
        )

    def _check_idle(self, what: str) -> None:
        if getattr(self.runner, "tp", None) is not None:
            raise RuntimeError(
                f"{what}: not supported with tensor parallel yet (every rank would need the "
                "scales); the checkpoint's K/V scales, or 1.0, are used"
            )
        # Blocks already in the cache (and the prefix cache) hold K/V quantized with the old
        # scales: scales change only on an engine that has not run a step.
        if self.stats.num_steps or self._inflight is not None:
            raise RuntimeError(
                f"{what}: this engine has run steps whose cached K/V used the old scales; set "
                "the scales on a fresh engine, before its first step"
            )

    def shutdown(self) -> None:
        """Release the engine's other processes now (tensor parallel: stop the worker ranks,
        leave the process group); also done when the engine is collected or the interpreter
        exits. The engine cannot step afterwards."""
        self.runner.shutdown()

    # ---- requests in ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | dict | None = None,
    ) -> None:
        """Queue a generation request (n samples share the prompt's KV blocks).

        `params` may be a dict of SamplingParams fields; invalid ones make an error output.
        """
        ids = self._prompt_ids(request_id, prompt)
        if ids is None:
            return
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except (SamplingParamsError, TypeError) as e:
                self._reject(request_id, ids, "bad_params", str(e))
                return
        if not isinstance(params, SamplingParams):
            self._reject(request_id, ids, "bad_params", f"expected SamplingParams, got {params!r}")
            return
        if params.stop and self.tokenizer is None:
            self._reject(request_id, ids, "bad_params", "stop strings need a tokenizer")
            return
        # Shared with the planner (request_checks.py), so `batchgen validate` predicts these.
        error = check_params(params, self.limits)
        if error is not None:
            self._reject(request_id, ids, error.code, error.message)
            return
        prepared = None
        if params.structured_outputs is not None:
            try:
                prepared = self._structured().prepare(params.structured_outputs)
            except ValueError as e:  # GrammarError (a ValueError) carries its own code
                code = getattr(e, "code", "bad_params")
                self._reject(request_id, ids, code, str(e))
                return
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seqs: list[Sequence] = []
        for i in range(params.n):
            seqs.append(
                Sequence(
                    next(self._seq_ids),
                    request_id,
                    ids,
                    params,
                    sample_index=i,
                    seed=sample_seed(seed, i),
                    parent=seqs[0] if i else None,
                )
            )
        request = Request(request_id, ids, params, seqs)
        if params.stop:
            request.stop_checkers = {
                s.seq_id: StopStringChecker(self.tokenizer, params.stop) for s in seqs
            }
        if params.logprobs is not None:
            request.logprobs = {s.seq_id: [] for s in seqs}
        if isinstance(prepared, Future):  # a new constraint: queued once it has compiled
            self._requests[request_id] = request
            self.structured.hold(prepared, request)
            return
        if prepared is not None:
            self.structured.add(seqs, prepared)
        self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Queue a request's sequences, or reject it (every sample has the same lengths: the
        first one's error is all of theirs)."""
        for seq in request.seqs:
            error = self.scheduler.add(seq)
            if error is not None:
                self._requests.pop(request.request_id, None)
                if self.structured is not None:
                    self.structured.release(s.seq_id for s in request.seqs)
                self._reject(request.request_id, request.prompt_token_ids, *error)
                return
        self._track(request, len(request.prompt_token_ids) * len(request.seqs))
        self._sample_for_calibration(request.prompt_token_ids)

    def _structured(self) -> StructuredOutputs:
        """The structured-output state, built on first use from the engine's tokenizer."""
        if self.structured is None:
            # Imported here: llguidance is needed only once a request has a constraint.
            from batchgen.engine.structured.grammar import GrammarCompiler
            from batchgen.engine.structured.manager import StructuredOutputs

            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs need the model's tokenizer; this engine has none"
                )
            compiler = GrammarCompiler(
                self.tokenizer.to_json(), self.limits.vocab_size, self.eos_token_ids
            )
            self.structured = StructuredOutputs(
                compiler, self.eos_token_ids, self.config.structured_output_threads
            )
        return self.structured

    def check_structured_outputs(self, constraint: StructuredOutputsParams) -> str | None:
        """Compile a constraint into the engine's cache; why it is refused, or None. The
        planner calls it for each row while it plans a shard, ahead of the rows' admission."""
        try:
            return self._structured().compiler.check(constraint)
        except ValueError as e:
            return str(e)

    def _admit_compiled(self) -> None:
        """Queue the requests whose constraint has compiled (reject those refused); when
        nothing else can run, wait for the first."""
        if self.structured is None or not self.structured.num_held:
            return
        idle = not self.scheduler.has_unfinished() and self._inflight is None
        for request, error in self.structured.ready(block=idle):
            if error is None:
                self._schedule(request)
                continue
            del self._requests[request.request_id]
            self._reject(request.request_id, request.prompt_token_ids, error.code, str(error))

    def add_score_request(
        self,
        request_id: str,
        prompt: list[int],
        candidates: list[list[int]],
        return_token_logprobs: bool = False,
    ) -> None:
        """Queue the scoring of each candidate continuation after `prompt` (token ids).

        Every candidate is a sequence of prompt + candidate tokens. The scheduler holds back a
        candidate while another one is computing the shared prompt blocks it would need, so it
        then takes them from the prefix cache: the prompt is computed once per request.
        """
        ids = self._prompt_ids(request_id, prompt)
        if ids is None:
            return
        request = Request(
            request_id,
            ids,
            _SCORE_PARAMS,
            [],
            num_candidates=len(candidates),
            return_token_logprobs=return_token_logprobs,
        )
        for i, cand in enumerate(candidates):
            error = self._check_ids(cand, "candidate")
            if error is None and not cand:
                error = ("empty_candidate", f"candidate {i} has no tokens")
            if error is None:
                seq = Sequence(
                    next(self._seq_ids),
                    request_id,
                    ids + list(cand),
                    _SCORE_PARAMS,
                    sample_index=i,
                    score_from=len(ids),
                )
                add_error = self.scheduler.add(seq)
                if add_error is None:
                    request.scores[i] = ScoreAccumulator()
                    request.seqs.append(seq)
                    continue
                error = tuple(add_error)
            request.score_errors[i] = (error[0], f"candidate {i}: {error[1]}")
        self._track(request, sum(s.num_tokens for s in request.seqs))
        if request.seqs:
            self._sample_for_calibration(ids)
        if not request.seqs:
            self._ready.append(request.output(self._decode))
            del self._requests[request_id]

    def _prompt_ids(self, request_id: str, prompt) -> list[int] | None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, str) and self.tokenizer is None:
            self._reject(request_id, [], "no_tokenizer", "this engine has no tokenizer: pass ids")
            return None
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = list(prompt)
        error = self._check_ids(ids, "prompt")
        if error is None and not ids:
            error = ("empty_prompt", "the prompt is empty (no tokens)")
        if error is not None:
            self._reject(request_id, ids if isinstance(ids, list) else [], *error)
            return None
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _check_ids(self, ids, what: str) -> tuple[str, str] | None:
        error = check_token_ids(ids, self.limits.vocab_size, what)
        return None if error is None else (error.code, error.message)

    def _reject(self, request_id: str, ids: list[int], code: str, message: str) -> None:
        self.stats.num_errors += 1
        self._ready.append(RequestOutput.failed(request_id, ids, code, message))

    def _sample_for_calibration(self, ids: list[int]) -> None:
        if (
            self._calibration is not None
            and len(self._calibration) < self.config.calibrate_kv_scales
        ):
            self._calibration.append(ids)

    def _track(self, request: Request, num_tokens: int) -> None:
        self._requests[request.request_id] = request
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += num_tokens

    # ---- stepping ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._ready)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the requests that finished (including rejected ones).

        While requests are unfinished the heap from before the run is frozen against full
        garbage collections (gc_pause.py); the step that finishes the last one unfreezes it.
        """
        if self.has_unfinished_requests():
            self._heap.hold()
        outputs = self._step()
        if not self.has_unfinished_requests():
            self._heap.release()
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One batch (see step).

        With async scheduling (the default) a step is launched on the device and the step
        before it is then resolved while it runs: its sampled tokens are read, stop conditions
        checked and finished requests returned. A sequence that met a stop token is thus
        scheduled once more; that extra token is dropped. The same tokens come out either way
        (up to the rounding of a differently composed batch, as with any change of batch).
        """
        self._admit_compiled()
        finished_outputs, self._ready = self._ready, []
        if self._calibration and self.scheduler.has_unfinished():
            self.calibrate_kv_scales(self._calibration)  # before anything reads the cache
        if not self.scheduler.has_unfinished():
            if self._inflight is not None:
                finished_outputs += self._resolve(self._pop_inflight())
            return finished_outputs
        out = self.scheduler.schedule()
        for seq in out.preempted:
            if seq.is_score:
                self._requests[seq.request_id].scores[seq.sample_index] = ScoreAccumulator()
        sampling = self._sampling_batch(out.scheduled)
        sample_seqs = [item.seq for item in out.scheduled if item.samples]
        constrained = self.structured is not None and self.structured.any_constrained(sample_seqs)
        fwd = self.runner.forward(out.scheduled, self._inflight_handle())
        handle = None if constrained else self.runner.sample(fwd, sampling)
        advanced = self.scheduler.advancing(out)
        launched = _Launched(handle, out, self.scheduler.advance(out), advanced)
        launched.epochs = [s.seq.num_preemptions for s in out.scheduled]
        self.stats.num_steps += 1
        if self._inflight is not None:
            finished_outputs += self._resolve(self._pop_inflight())
        if constrained:
            # A row's mask depends on its previous token, which the step resolved just above
            # sampled: the masks are filled now, while the device runs this step's model pass,
            # and the draw is enqueued behind it.
            launched.handle = self._sample_constrained(fwd, sampling, sample_seqs)
        self._inflight = launched
        if not self.config.async_scheduling:
            finished_outputs += self._resolve(self._pop_inflight())
        return finished_outputs

    def _sample_constrained(self, fwd, sampling: SamplingBatch, seqs: list[Sequence]) -> StepHandle:
        """Fill the sampling rows' token masks on the host and enqueue the masked draw."""
        bitmask = self.runner.bitmask_buffer(len(seqs), self.structured.words)
        for seq, message in self.structured.fill(bitmask, seqs):
            self._fail(
                seq, "structured_output_failed", f"the grammar refused the output: {message}"
            )
        return self.runner.sample(fwd, sampling, bitmask)

    def _fail(self, seq: Sequence, code: str, message: str) -> None:
        """End seq's request as an error output (returned once its steps in flight resolve)."""
        request = self._requests.get(seq.request_id)
        if request is None or request.error is not None:
            return
        request.error = (code, message)
        self.stats.num_errors += 1
        for s in request.seqs:
            self.scheduler.finish(s, "error")

    def _inflight_handle(self):
        return self._inflight.handle if self._inflight is not None else None

    def _pop_inflight(self) -> _Launched:
        launched, self._inflight = self._inflight, None
        return launched

    def _resolve(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's results into its sequences; return requests now complete."""
        tokens, logprobs, scores = launched.handle.result()
        scheduled = launched.output.scheduled
        for row, logprob, is_argmax in scores:
            seq = scheduled[row].seq
            if seq.num_preemptions != launched.epochs[row]:
                continue  # preempted since: its positions are computed (and scored) again
            self._requests[seq.request_id].scores[seq.sample_index].add(logprob, is_argmax)
            self.stats.num_scored_tokens += 1
        for i, seq, index in launched.placeholders:
            token = tokens[i]
            if not self.scheduler.resolve_token(seq, index, token):
                continue  # the sequence stopped at an earlier token
            self.stats.num_generated_tokens += 1
            request = self._requests[seq.request_id]
            if logprobs is not None and seq.seq_id in request.logprobs:
                request.logprobs[seq.seq_id].append(logprobs[i])
            checker = request.stop_checkers.get(seq.seq_id)
            if checker is not None and checker.add(token):
                self.scheduler.stop_at(seq, index, "stop")
        self.stats.num_preemptions = self.scheduler.num_preemptions
        outputs: list[RequestOutput] = []
        for seq in launched.advanced:
            seq.num_inflight -= 1
        for item in scheduled:
            seq = item.seq
            request = self._requests.get(seq.request_id)
            if request is not None and request.finished() and request.settled():
                self.stats.num_cached_tokens += sum(s.num_cached_tokens for s in request.seqs)
                flags = None
                if self.structured is not None and request.params.structured_outputs:
                    flags = self.structured.finish(request)
                outputs.append(request.output(self._decode, flags))
                del self._requests[seq.request_id]
                self.runner.sampler.penalties.release(s.seq_id for s in request.seqs)
        return outputs

    def _sampling_batch(self, scheduled) -> SamplingBatch:
        """Per sampling sequence: params, random-stream key and token index; token histories
        (references, not copies) and suppressed ids only for the rows that need them (this runs
        every step)."""
        seqs = [item.seq for item in scheduled if item.samples]
        params = [seq.params for seq in seqs]
        steps = [len(seq.token_ids) - seq.num_prompt_tokens for seq in seqs]
        empty: list[int] = []
        histories: list[History | None] = [None] * len(seqs)
        suppress = [empty] * len(seqs)
        for i, (seq, p, step) in enumerate(zip(seqs, params, steps)):
            if p.has_penalties:
                histories[i] = History(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
            if step < p.min_tokens:
                suppress[i] = sorted(set(p.stop_token_ids) | self.eos_token_ids)
        return SamplingBatch(params, [seq.seed for seq in seqs], steps, histories, suppress)
