"""ModelRunner: owns the model, the KV cache and the sampler; runs one scheduled step on the device.

The one place where the scheduler's Python lists become device tensors.
"""

from __future__ import annotations

import torch

from batchgen.config import ConfigError, EngineConfig
from batchgen.cpu_threads import cpu_threads_to_set
from batchgen.engine.cuda_graph import DecodeGraphs, bucket_sizes
from batchgen.engine.host_to_device import PinnedStager
from batchgen.engine.mixed_graph import MixedGraphs, mixed_bucket_sizes
from batchgen.engine.prompt_allowance import auto_chunk_tokens
from batchgen.engine.request_checks import check_cache_size
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.engine.scheduler_output import ScheduledSequence
from batchgen.engine.step_handle import StepHandle
from batchgen.engine.step_inputs import StepInputs, build_step_inputs, pad_block_tables
from batchgen.kernels import ops
from batchgen.layers import gemm_tuning, linear
from batchgen.layers.context import AttentionContext
from batchgen.layers.int4_linear import weight_count
from batchgen.models.config import ModelConfig
from batchgen.models.loader import load_model

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
    """Loads the model, sizes and allocates the paged KV cache, executes steps."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.model, _ = load_model(config.model, config.dtype, self.device, config.allow_pickle)
        self._init(max_model_len)

    @classmethod
    def from_model(cls, config: EngineConfig, model, max_model_len: int) -> ModelRunner:
        """Wrap an already-built model (random-weight benchmark presets)."""
        self = cls.__new__(cls)
        self.config = config
        self.model_config = model.config
        self.device = next(model.parameters()).device
        self.model = model
        self._init(max_model_len)
        return self

    def _init(self, max_model_len: int) -> None:
        self.dtype = next(self.model.parameters()).dtype
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
        # The scheduler's mixed_chunk_tokens, the option resolved for this model.
        self.mixed_chunk_tokens = self.config.mixed_chunk_tokens
        if self.mixed_chunk_tokens is None:
            num_params = weight_count(self.model)  # 4-bit projections count in x out
            self.mixed_chunk_tokens = auto_chunk_tokens(
                num_params, self.config.max_num_batched_tokens
            )
        self.stager = PinnedStager(self.device)
        self.sampler = Sampler(self.stager.to_device)
        self.num_kv_blocks = self._num_kv_blocks()
        too_small = check_cache_size(self.num_kv_blocks * self.block_size, max_model_len)
        if too_small is not None:
            raise ConfigError(too_small)
        c = self.model_config
        # [2 (k, v), layers, blocks, block_size, kv_heads, head_dim]; per-layer views below.
        self.kv_cache = torch.zeros(
            2,
            c.num_hidden_layers,
            self.num_kv_blocks,
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = [
            (self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(c.num_hidden_layers)
        ]
        self.graphs = self.mixed_graphs = None
        self.tune_report = None
        linear.clear_tuning()  # shapes an earlier runner in this process tuned
        if self.device.type == "cuda" and not self.config.enforce_eager:
            chunk = self.mixed_chunk_tokens
            mixed = mixed_bucket_sizes(self.config.max_num_seqs) if chunk else []
            if self.config.tune_gemms:
                sizes = bucket_sizes(self.config.max_num_seqs)
                rows = sizes + [s + chunk for s in mixed]
                groups = self.model.projection_groups()
                self.tune_report = gemm_tuning.tune_projections(groups, rows)
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.config.max_num_seqs,
                max_model_len,
                self.block_size,
                self.stager.to_device,
            )
            if chunk:
                self.mixed_graphs = MixedGraphs(
                    self.model,
                    self.kv_caches,
                    mixed,
                    chunk,
                    max_model_len,
                    self.block_size,
                    self.stager.to_device,
                    self.graphs.pool,
                )

    def mixed_chunk_room(self, num_decode_rows: int) -> int:
        """Prompt tokens a mixed step with num_decode_rows decode rows may carry beyond
        mixed_chunk_tokens: its mixed graph's padding decode rows (0 without mixed graphs)."""
        if self.mixed_graphs is None:
            return 0
        return self.mixed_graphs.riding_rows(num_decode_rows)

    def block_bytes(self) -> int:
        c = self.model_config
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        budget = int(self.config.cpu_kv_cache_gb * 2**30) // self.block_bytes()
        # No point holding more than every sequence at full length.
        needed = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(budget, needed))

    @torch.inference_mode()
    def _profile_gpu_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization x total after weights and a peak step."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * 4)
        lengths = []
        while sum(lengths) < num_tokens:
            lengths.append(min(self.max_model_len, num_tokens - sum(lengths)))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        hidden = self.model(ids, pos, AttentionContext.for_prompts(lengths, self.device))
        self.model.compute_logits(hidden[: self.config.max_num_seqs]).float()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        del hidden
        torch.cuda.empty_cache()
        budget = min(int(total * self.config.gpu_memory_utilization) - peak, free)
        return max(0, budget // self.block_bytes())

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

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledSequence],
        sampling: SamplingBatch,
        previous: StepHandle | None = None,
    ) -> StepHandle:
        """Enqueue one step on the device and return at once; `result()` waits for it.

        `previous` is the step still in flight: its sampled tokens, which this step's decode
        rows may take as input (PENDING_TOKEN in their token_ids), are read on the device.
        """
        self.stager.begin_step()
        step = build_step_inputs(scheduled, self.block_size)
        patch = None
        if step.pending_rows:
            patch = self._pending_patch(step, previous)
        sample_rows = step.sample_rows
        if self.graphs is not None and self.graphs.can_run(step):
            hidden = self.graphs.run(step, patch)  # [B, H]
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(step):
            hidden = self.mixed_graphs.run(step, patch)  # [bs + P, H]
            sample_rows = self.mixed_graphs.graph_rows(step, sample_rows)
        else:
            input_ids = self._tensor(step.input_ids, torch.int64)
            if patch is not None:
                patch(input_ids)
            positions = self._tensor(step.positions, torch.int64)
            hidden = self.model(input_ids, positions, self._context(step))  # [T, H]
        tokens = raw_logprobs = None
        if sample_rows:
            rows = self._tensor(sample_rows, torch.int64)
            logits = self.model.compute_logits(hidden[rows])  # [N, V], the model's dtype
            tokens, raw_logprobs = self.sampler.sample(logits, sampling)
        sample_ids = [item.seq.seq_id for item in scheduled if item.samples]
        return StepHandle(
            self.stager,
            tokens,
            raw_logprobs,
            sampling.params,
            {seq_id: i for i, seq_id in enumerate(sample_ids)},
            *self._score(hidden, step),
        )

    def _pending_patch(self, step: StepInputs, previous: StepHandle | None):
        """A function writing the in-flight step's sampled tokens into input_ids [T]."""
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has pending input tokens but no step in flight")
        src = [previous.sample_index[seq.seq_id] for seq in step.pending_seqs]
        idx = self._tensor([step.pending_rows, src], torch.int64)  # [2, P]: row, source

        def patch(input_ids: torch.Tensor) -> None:
            input_ids[idx[0]] = previous.tokens[idx[1]]

        return patch

    def _score(self, hidden: torch.Tensor, step: StepInputs):
        """Log-prob and argmax match of every scored position, as device tensors (read on
        resolve): (owners [n] host list, logprobs [n] float32, matches [n] bool)."""
        lps, matches = [], []
        for lo in range(0, len(step.score_rows), _SCORE_CHUNK):
            rows = self._tensor(step.score_rows[lo : lo + _SCORE_CHUNK], torch.int64)
            targets = self._tensor(step.score_targets[lo : lo + _SCORE_CHUNK], torch.int64)
            logits = self.model.compute_logits(hidden[rows])  # [n, V], never all positions
            lps.append(ops.token_logprobs(logits, targets))  # [n] float32
            matches.append(logits.argmax(dim=-1) == targets)
        if not lps:
            return step.score_owner, None, None
        return step.score_owner, torch.cat(lps), torch.cat(matches)
