"""ModelRunner: owns the model, the KV cache and the sampler; runs one scheduled step on the device.

The one place where the scheduler's Python lists become device tensors. With tensor parallel,
rank 0's runner also starts the other ranks and sends each step's inputs to their runners,
which run the same forward in lockstep (`execute`); see batchgen.engine.tensor_parallel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator

import torch

from batchgen.config import ConfigError, EngineConfig
from batchgen.cpu_threads import cpu_threads_to_set
from batchgen.distributed.group import TensorParallel, TensorParallelError
from batchgen.distributed.one_shot import select_one_shot
from batchgen.distributed.watchdog import Watchdog
from batchgen.distributed.workers import WorkerError, WorkerPool
from batchgen.engine import mixed_graph
from batchgen.engine.bitmask_upload import BitmaskUploader
from batchgen.engine.cuda_graph import smallest_bucket
from batchgen.engine.graph_capture import capture_graphs
from batchgen.engine.host_to_device import PinnedStager
from batchgen.engine.kv_cache_size import kv_block_bytes, num_kv_blocks
from batchgen.engine.kv_scales import KVScales
from batchgen.engine.prompt_allowance import auto_chunk_tokens
from batchgen.engine.rank_guard import RankGuard
from batchgen.engine.request_checks import check_cache_size
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.engine.scheduler_output import ScheduledSequence
from batchgen.engine.step_handle import StepForward, StepHandle
from batchgen.engine.step_inputs import StepInputs, build_step_inputs, pad_block_tables
from batchgen.engine.tensor_parallel import (
    ModelBuilder,
    rank_device,
    resolve_kind,
    start_tensor_parallel,
)
from batchgen.kernels import ops
from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.layers import int4_tuning, linear
from batchgen.layers.context import AttentionContext
from batchgen.layers.int4_linear import weight_count
from batchgen.models.config import ModelConfig
from batchgen.models.loader import CheckpointLoader

# Rows of logits computed at once for scoring, bounding the [rows, vocab] buffer.
_SCORE_CHUNK = 1024


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: no CUDA device is visible to torch")
    resolved = torch.device(device)
    count = torch.cuda.device_count() if resolved.type == "cuda" else 0
    if resolved.index is not None and resolved.index >= count:
        raise ConfigError(
            f"device={device!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return resolved


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, executes steps.

    Args:
        config, model_config, max_model_len: the engine's settings and model.
        build: (device, tp) -> model; default: the checkpoint at config.model.
        tp / peers / watchdog: given on tensor-parallel ranks > 0 (their process group, their
            link to rank 0 and the deadline of their start-up phases, see tp_worker.py); rank
            0's runner makes its own when config.tensor_parallel_size > 1.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        build: ModelBuilder | None = None,
        tp: TensorParallel | None = None,
        peers=None,
        watchdog: Watchdog | None = None,
    ):
        self.config = config
        self.model_config = model_config
        self.tp, self.peers = tp, peers
        self.device = tp.device if tp is not None else resolve_device(config.device)
        build = build or CheckpointLoader(
            config.model, config.dtype, config.allow_pickle, config.quantization
        )
        if tp is None and config.tensor_parallel_size > 1:  # rank 0 starts the others
            self.device = rank_device(self.device, 0)
            self.tp, self.peers = start_tensor_parallel(
                config, model_config, max_model_len, build, self.device
            )
            self._stop = weakref.finalize(self, _close, self.tp, self.peers)
            if self.tp.backend == "nccl":  # a step waiting on a dead rank's NCCL kernels returns
                self.peers.on_failure = self.tp.close
            watchdog = Watchdog(0, _aborter(self.tp))
        self.guard = RankGuard(self.tp, watchdog if self.tp is not None else None)
        try:
            self.model = build(self.device, self.tp)
            self._init(max_model_len)
            self.guard.started()
        except WorkerError as e:
            self.guard.close()
            self.shutdown()
            raise resolve_kind(e.kind, str(e)) or e from None
        except BaseException as e:
            failure = self._tp_failure(e)
            self.guard.close()
            self.shutdown()
            if failure is not None:
                raise failure from e
            raise

    @classmethod
    def from_model(cls, config: EngineConfig, model, max_model_len: int) -> ModelRunner:
        """Wrap an already-built model (random-weight benchmark presets; one device)."""
        self = cls.__new__(cls)
        self.config = config
        self.model_config = model.config
        self.device = next(model.parameters()).device
        self.tp = self.peers = None
        self.guard = RankGuard(None)
        self.model = model
        self._init(max_model_len)
        return self

    def _tp_failure(self, error: BaseException) -> TensorParallelError | None:
        """Rank 0, start-up failed with `error`: the tensor-parallel cause to raise instead (a
        phase that ran out of time, a worker that died), or None to raise error itself."""
        if self.guard.expired is not None:
            return TensorParallelError(self.guard.expired)
        if not isinstance(self.peers, WorkerPool) or isinstance(
            error, (ConfigError, TensorParallelError)
        ):
            return None
        try:
            self.peers.raise_if_died(error)
        except TensorParallelError as died:
            return died
        return None

    def _agree(self, phase: str, value, reduce=None):
        """One value settled across the tensor-parallel ranks at a start-up phase (rank 0 sends
        reduce([its value, rank 1's, ...]) to all); `value` itself without tensor parallel."""
        if self.peers is None:
            return value
        return self.peers.agree(phase, value, reduce)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (rank 0; a no-op
        otherwise and when done before). The engine cannot run steps after it."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            self.graphs = self.mixed_graphs = None  # graphs captured collectives: free first
            stop()

    def _init(self, max_model_len: int) -> None:
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = FP8_DTYPE if self.config.kv_cache_dtype == "fp8" else self.dtype
        self.kv_scales = KVScales(self.model)
        if self.device.type == "cpu":
            # torch's pool defaults to every CPU of the affinity mask, ignoring Slurm's
            # allocation and the cgroup quota (batchgen/cpu_threads.py says why that matters).
            threads = cpu_threads_to_set(self.config.cpu_threads)
            if threads is not None:
                torch.set_num_threads(threads)
        # Before anything runs the model: graphs and the memory profile see the folded form.
        if self.config.fold_norms:
            self.model.fold_norms_()  # a no-op for models it cannot fold (model.norms_folded)
        if self.config.kn_weights and self.device.type == "cuda":
            self.model.kn_weights_()  # cuBLAS's NN kernels read the wide weights faster
        self.block_size = self.config.block_size
        self.max_model_len = max_model_len
        # Every rank has its share: the whole model's size is their sum.
        # (4-bit projections count their in x out weights.)
        num_params = self._agree("loaded", weight_count(self.model), sum)
        # Mixed-step graphs: rank 0's switch holds for every rank (mixed_graph.py).
        mixed_graphs = self.tp is None or self._agree(
            "mixed graphs", bool(mixed_graph.TENSOR_PARALLEL_MIXED_GRAPHS), lambda vs: vs[0]
        )
        # The scheduler's mixed_chunk_tokens, the option resolved for this model.
        self.mixed_chunk_tokens = self.config.mixed_chunk_tokens
        if self.mixed_chunk_tokens is None:
            self.mixed_chunk_tokens = auto_chunk_tokens(
                num_params, self.config.max_num_batched_tokens
            )
            if not mixed_graphs:
                self.mixed_chunk_tokens = 0
        self.stager = PinnedStager(self.device)
        self.sampler = Sampler(self.stager.to_device)
        self.masks = BitmaskUploader(self.stager, self.device, self.config.max_num_seqs)
        self._last_tokens = None  # a worker's copy of the last step's sampled tokens
        c = self.model_config
        self.num_kv_heads = self.model.part.num_kv_heads  # this rank's (all without tp)
        block_bytes = kv_block_bytes(
            c.num_hidden_layers, self.num_kv_heads, c.head_dim, self.block_size, self.kv_dtype
        )
        with self.guard.phase("memory profile"):  # a forward with collectives (GPU)
            blocks = num_kv_blocks(self.model, self.config, max_model_len, self.device, block_bytes)
        self.num_kv_blocks = self._agree("kv blocks", blocks, min)  # what every rank holds
        too_small = check_cache_size(self.num_kv_blocks * self.block_size, max_model_len)
        if too_small is not None:
            raise ConfigError(too_small)
        # [2 (k, v), layers, blocks, block_size, kv_heads, head_dim]; per-layer views below.
        self.kv_cache = torch.zeros(
            2,
            c.num_hidden_layers,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_heads,
            c.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.kv_caches = [
            (self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(c.num_hidden_layers)
        ]
        self.graphs = self.mixed_graphs = None
        self.tune_report = self.one_shot = None
        linear.clear_tuning()  # shapes an earlier runner in this process tuned
        # tune_gemms also decides whether 4-bit projections time their tiles (else heuristic).
        int4_tuning.TUNE = self.config.tune_gemms
        if self.tp is not None and not self.config.disable_custom_all_reduce:
            # (threshold bytes, timings, why off): measured with every rank; see one_shot.py.
            with self.guard.phase("one-shot all-reduce set-up"):
                self.one_shot = select_one_shot(
                    self.tp, self._agree, c.hidden_size, self.config.max_num_seqs, self.dtype
                )
        captured = capture_graphs(
            self.model,
            self.kv_caches,
            self.config,
            max_model_len,
            self.num_kv_blocks,
            self.mixed_chunk_tokens if mixed_graphs else 0,
            self.stager.to_device,
            self.tp,
            self.guard,
            self._agree,
        )
        self.graphs, self.mixed_graphs = captured.graphs, captured.mixed_graphs
        self.tune_report = captured.tune_report
        self._agree("ready", None, lambda vs: None)

    def mixed_chunk_room(self, num_decode_rows: int) -> int:
        """Prompt tokens a mixed step with num_decode_rows decode rows may carry beyond
        mixed_chunk_tokens: its mixed graph's padding decode rows (0 without mixed graphs)."""
        if self.mixed_graphs is None:
            return 0
        return self.mixed_graphs.riding_rows(num_decode_rows)

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return self.stager.to_device(values, dtype)

    def _context(self, step: StepInputs) -> AttentionContext:
        tables = pad_block_tables(step.block_tables, multiple=16)  # [B, max_blocks]
        d = step.num_decode_rows
        split = {}
        if 0 < d < len(step.seq_lens):
            # Mixed: decode rows [0, d), then chunks with their own (rebased, freshly allocated
            # and so aligned) metadata; slices at row d would be new kernel specializations.
            split = dict(
                num_decode_rows=d,
                prefill_cu_seqlens_q=self._tensor(
                    [c - d for c in step.cu_seqlens_q[d:]], torch.int32
                ),
                prefill_seq_lens=self._tensor(step.seq_lens[d:], torch.int32),
                prefill_block_tables=self._tensor(tables[d:], torch.int32),
            )
        return AttentionContext(
            cu_seqlens_q=self._tensor(step.cu_seqlens_q, torch.int32),
            seq_lens=self._tensor(step.seq_lens, torch.int32),
            max_seqlen_q=step.max_seqlen_q,
            max_seqlen_k=max(step.seq_lens),
            slot_mapping=self._tensor(step.slot_mapping, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            kv_caches=self.kv_caches,
            is_decode=step.is_decode,
            **split,
        )

    def launch(
        self,
        scheduled: list[ScheduledSequence],
        sampling: SamplingBatch,
        previous: StepHandle | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> StepHandle:
        """Enqueue one step on the device and return at once; `result()` waits for it.

        `previous` is the step still in flight: its sampled tokens, which this step's decode
        rows may take as input (PENDING_TOKEN in their token_ids), are read on the device.
        `bitmask`: the sampling rows' allowed tokens (see `sample`).

        Tensor parallel: the step's inputs go to the other ranks first (their runners' execute),
        then every rank runs the forward; rank 0 samples and broadcasts the sampled tokens.

        Raises:
            TensorParallelError: another rank died or failed (the engine cannot go on).
        """
        return self.sample(self.forward(scheduled, previous), sampling, bitmask)

    @torch.inference_mode()
    def forward(
        self, scheduled: list[ScheduledSequence], previous: StepHandle | None = None
    ) -> StepForward:
        """Enqueue a step's model pass and its sampling rows' logits; `sample` draws from them.

        Split from the draw so the host can prepare what the draw needs (structured output's
        token masks, which depend on the tokens of `previous`) while the device runs the pass.
        Tensor parallel: the other ranks run the same pass and the logits gather, then wait in
        the sampled tokens' broadcast, which `sample` (rank 0 only) completes.
        """
        with self._tp_errors():
            if self.peers is not None:
                self.peers.check()
            self.stager.begin_step()
            step = build_step_inputs(scheduled, self.block_size)
            sources = self._pending_sources(step, previous)
            if self.peers is not None:
                self.peers.send_step((dataclasses.replace(step, pending_seqs=[]), sources))
            previous_tokens = previous.tokens if previous is not None else None
            hidden, sample_rows = self._forward(step, previous_tokens, sources)
            logits = None
            if sample_rows:
                logits = self._logits(hidden, sample_rows)  # [N, V] on rank 0, the model's dtype
            sample_ids = [item.seq.seq_id for item in scheduled if item.samples]
            return StepForward(step, hidden, logits, sample_ids)

    def bitmask_buffer(self, rows: int, words: int) -> torch.Tensor:
        """A host [rows, words] int32 buffer for the step in progress's token masks (pinned on
        CUDA); fill it, then pass it to `sample`."""
        return self.stager.host_buffer((rows, words), torch.int32)

    @torch.inference_mode()
    def sample(
        self, fwd: StepForward, sampling: SamplingBatch, bitmask: torch.Tensor | None = None
    ) -> StepHandle:
        """Enqueue the draw of a forward's sampling rows (and its scored positions' log-probs);
        return the step's handle at once.

        bitmask: [N, ceil(V / 32)] int32 from `bitmask_buffer`, the N sampling rows' allowed
        tokens, uploaded here and applied inside the sampling kernels; None: no constraint.
        Tensor parallel: rank 0 holds the whole vocabulary's logits (gathered in `forward`), so
        the masks apply here alone; the other ranks receive the masked draw's tokens.
        """
        with self._tp_errors():
            tokens = raw_logprobs = None
            if fwd.logits is not None:
                mask = self.masks.upload(bitmask) if bitmask is not None else None
                tokens, raw_logprobs = self.sampler.sample(fwd.logits, sampling, mask)
                if self.tp is not None:
                    self.tp.broadcast_(tokens)  # the next step's pending inputs, on every rank
            return StepHandle(
                self.stager,
                tokens,
                raw_logprobs,
                sampling.params,
                {seq_id: i for i, seq_id in enumerate(fwd.sample_ids)},
                *self._score(fwd.hidden, fwd.step),
                check=self.peers.check if self.peers is not None else None,
            )

    @contextlib.contextmanager
    def _tp_errors(self) -> Iterator[None]:
        """Tensor parallel: an error raised because another rank died says which rank."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as e:
            if self.peers is not None:  # a collective broke because a rank died: say which
                self.peers.raise_if_died(e)
            raise

    @torch.inference_mode()
    def execute(self, message: tuple[StepInputs, list[int] | None]) -> None:
        """A tensor-parallel rank > 0: run the step rank 0's launch described, in lockstep with
        it (same forward, the logits gathers, the sampled tokens' broadcast)."""
        step, sources = message
        self.stager.begin_step()
        hidden, sample_rows = self._forward(step, self._last_tokens, sources)
        self._last_tokens = None
        if sample_rows:
            self._logits(hidden, sample_rows)
            tokens = torch.empty(len(sample_rows), dtype=torch.int64, device=self.device)
            self._last_tokens = self.tp.broadcast_(tokens)
        self._score(hidden, step)

    def _forward(
        self, step: StepInputs, previous_tokens: torch.Tensor | None, sources: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        """The model over the step: (hidden [rows, H], the rows of hidden to sample)."""
        patch = None
        if sources is not None:
            patch = self._pending_patch(step.pending_rows, sources, previous_tokens)
        sample_rows = step.sample_rows
        decode = self.graphs is not None and self.graphs.can_run(step)
        mixed = not decode and self.mixed_graphs is not None and self.mixed_graphs.can_run(step)
        if self.guard.logging:
            self.guard.step(step, self._run_kind(step, decode, mixed))
        if decode:
            hidden = self.graphs.run(step, patch)  # [B, H]
        elif mixed:
            hidden = self.mixed_graphs.run(step, patch)  # [bs + P, H]
            sample_rows = self.mixed_graphs.graph_rows(step, sample_rows)
        else:
            input_ids = self._tensor(step.input_ids, torch.int64)
            if patch is not None:
                patch(input_ids)
            positions = self._tensor(step.positions, torch.int64)
            hidden = self.model(input_ids, positions, self._context(step))  # [T, H]
        return hidden, sample_rows

    def _run_kind(self, step: StepInputs, decode: bool, mixed: bool) -> str:
        """How a step runs, for the step log: its graph and bucket, or eager."""
        if decode:
            return f"decode-graph bs={smallest_bucket(self.graphs.sizes, len(step.seq_lens))}"
        if mixed:
            bs = smallest_bucket(self.mixed_graphs.sizes, step.num_decode_rows)
            return f"mixed-graph bs={bs}+{self.mixed_graphs.chunk}"
        return "eager"

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Logits [n, V] of hidden's rows `rows`; None on tensor-parallel ranks > 0 (they
        compute their vocabulary share for rank 0's gather)."""
        return self.model.compute_logits(hidden[self._tensor(rows, torch.int64)])

    def _pending_sources(self, step: StepInputs, previous: StepHandle | None) -> list[int] | None:
        """For each pending row, its token's index in the in-flight step's sampled tokens."""
        if not step.pending_rows:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has pending input tokens but no step in flight")
        return [previous.sample_index[seq.seq_id] for seq in step.pending_seqs]

    def _pending_patch(self, rows: list[int], sources: list[int], tokens: torch.Tensor | None):
        """A function writing tokens[sources] (the in-flight step's sampled tokens, on the
        device) into input_ids [T] at `rows`."""
        if tokens is None:
            raise RuntimeError("a step has pending input tokens but no sampled tokens")
        idx = self._tensor([rows, sources], torch.int64)  # [2, P]: row, source

        def patch(input_ids: torch.Tensor) -> None:
            input_ids[idx[0]] = tokens[idx[1]]

        return patch

    def _score(self, hidden: torch.Tensor, step: StepInputs):
        """Log-prob and argmax match of every scored position, as device tensors (read on
        resolve): (owners [n] host list, logprobs [n] float32, matches [n] bool)."""
        lps, matches = [], []
        for lo in range(0, len(step.score_rows), _SCORE_CHUNK):
            logits = self._logits(hidden, step.score_rows[lo : lo + _SCORE_CHUNK])  # [n, V]
            if logits is None:
                continue  # a rank > 0: its share went into rank 0's gather
            targets = self._tensor(step.score_targets[lo : lo + _SCORE_CHUNK], torch.int64)
            lps.append(ops.token_logprobs(logits, targets))  # [n] float32
            matches.append(logits.argmax(dim=-1) == targets)
        if not lps:
            return step.score_owner, None, None
        return step.score_owner, torch.cat(lps), torch.cat(matches)


def _aborter(tp: TensorParallel):
    """Rank 0's watchdog action (its thread): abort the NCCL communicators, so the call waiting
    on the other ranks returns and start-up raises the watchdog's message."""

    def abort(message: str) -> None:
        if tp.backend == "nccl":
            tp.close()

    return abort


def _close(tp: TensorParallel, pool) -> None:
    """Stop the workers, then leave the process group (rank 0's shutdown and finalizer)."""
    try:
        pool.close()
    finally:
        tp.close()
