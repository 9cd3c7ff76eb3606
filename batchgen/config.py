"""EngineConfig: the frozen, validated settings of one engine instance."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from batchgen.short_repr import short_repr

# auto | cpu | cuda | cuda:N, the device strings the runner resolves (torch accepts more).
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


class ConfigError(ValueError):
    """An engine option has a value that cannot be used; the message names the option."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine options (the `model:` section of a job file beyond path and dtype).

    Args:
        model: path to a Hugging Face model directory.
        dtype: "auto" (the checkpoint's torch_dtype; float32 on CPU), "bfloat16", "float16",
            "float32".
        quantization: None, or "fp8": a 16-bit checkpoint's decoder projections quantized at
            load to FP8 e4m3 (per-output-channel weight scales, activations quantized per token
            as they enter each projection); lm_head and the embedding stay 16-bit. A checkpoint
            with a quantization_config (FP8 ones: batchgen.models.quantization) runs as it says
            with or without this option.
        kv_cache_dtype: "auto" (the activations' dtype) or "fp8" (e4m3: half the bytes of a
            16-bit cache, twice the tokens in the same memory). Each layer's K and V are stored
            divided by a per-layer scale: the checkpoint's (compressed-tensors kv_cache_scheme
            k_scale / v_scale), else 1.0, unless calibrate_kv_scales sets them.
        calibrate_kv_scales: with kv_cache_dtype fp8, N > 0 sets every layer's K/V scales once,
            before the first request runs, from max |k| and |v| over the first N prompts the
            engine receives (scale = max / 448); `batchgen run` takes the job's first N input
            rows instead and keeps the scales in the output directory for resumes. 0: off.
        device: "auto" (cuda if present, else cpu), "cuda", "cuda:N" or "cpu".
        block_size: tokens per KV-cache block.
        num_kv_blocks: fixed number of KV blocks; None sizes the cache from memory.
        gpu_memory_utilization: fraction of GPU memory the engine may use (weights,
            activations and KV cache together).
        cpu_kv_cache_gb: KV-cache size on CPU when num_kv_blocks is None.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: longest prompt + output; None takes the model's own limit.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        enforce_eager: never use CUDA graphs.
        async_scheduling: schedule and launch step N+1 while step N runs on the device, then
            read step N's tokens (hides the host's per-step work). Outputs do not depend on it,
            except where a batch composed differently rounds differently.
        admission_interval: while the running batch is full (max_num_seqs or KV blocks) and
            prompts wait, try to admit them only every this many steps, or sooner once
            max_num_seqs // 16 sequences have finished, so the prompts that finished sequences
            make room for are prefilled together in one mixed step (mixed steps run eagerly,
            at a host cost per step); 1 tries every step.
        fold_norms: fold each decoder layer's two RMSNorm weights into the projections they
            feed (qkv, gate_up) when the model is loaded, so a layer runs no norm or
            residual-add kernel (the kernels after those projections apply the row scale;
            o / down add into the residual stream). Same function, rounded differently: off
            keeps Hugging Face's order of roundings. Models with qkv or MLP biases are never
            folded.
        kn_weights: on CUDA, store the gate_up, down and (untied) lm_head weights K-major
            (the memory of W.T, same shape and values), so cuBLAS runs those projections as
            NN products, whose kernels read gate_up faster at decode sizes on the H100 (nano:
            0-1% on llama3.1-8b in three same-call A/Bs). Products round as another kernel's
            would.
        tune_gemms: on CUDA, before the CUDA graphs are captured, time cuBLAS's pick against
            cuBLASLt's candidate algorithms for each decoder projection at each row count the
            graphs run, and use the fastest (batchgen.layers.linear); 4-bit projections time
            their kernel's tiles at the first use of each row count (layers/int4_tuning.py).
            Costs seconds at start (minutes for a 4-bit 70B model's first run on a machine).
        mixed_chunk_tokens: 0 (off), or P: prompts are admitted longest max_tokens first and
            prefilled P tokens at a time inside decode steps (at most 4 prompts a step, one CUDA
            graph per decode bucket), where a large model's decode leaves the tensor cores
            idle; prompts that could no longer finish within the longest running sequence are
            prefilled at once. None (auto): 128 for models of 4B parameters or more, else 0
            (measured: +6% on llama3.1-8b nano, -3% on qwen3-0.6b; see README).
        allow_pickle: permit pickle `.bin` checkpoints (loaded with weights_only=True).
        cpu_threads: torch threads on a CPU device; None: the CPUs this process may use (its
            affinity mask, at most SLURM_CPUS_PER_TASK and the cgroup CPU quota), or
            OMP_NUM_THREADS when that is set (batchgen/cpu_threads.py).
        seed: seeds weight-free randomness (the draw of seeds for requests without one).
        structured_output_threads: threads that fill structured output's token masks each
            step (None: llguidance's default, 80% of the CPUs up to 32).
        tensor_parallel_size: split the model over this many GPUs (CPU processes on CPU): each
            rank holds its share of the attention heads, MLP columns and vocabulary, loaded
            slice by slice from the checkpoint, and the engine's process drives the others
            (batchgen.engine.tensor_parallel). Must divide the attention heads, the
            intermediate size and the vocabulary; the GPUs are cuda:K .. cuda:K+N-1 for
            device cuda:K.
        disable_custom_all_reduce: with tensor parallel on GPUs, always all-reduce through
            NCCL; otherwise small all-reduces (decode steps) run torch's one-shot
            symmetric-memory kernel where a start-up measurement finds it faster.
    """

    model: str
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    calibrate_kv_scales: int = 0
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gb: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = True
    admission_interval: int = 32
    fold_norms: bool = True
    kn_weights: bool = True
    tune_gemms: bool = True
    mixed_chunk_tokens: int | None = None
    allow_pickle: bool = False
    cpu_threads: int | None = None
    seed: int = 0
    structured_output_threads: int | None = None
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(
                f"dtype={short_repr(self.dtype)}: expected one of auto, bfloat16, float16, float32"
            )
        if self.quantization not in (None, "fp8"):
            raise ConfigError(
                f"quantization={short_repr(self.quantization)}: expected null or fp8 (FP8 "
                "checkpoints are detected from their quantization_config)"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(
                f"kv_cache_dtype={short_repr(self.kv_cache_dtype)}: expected auto or fp8 (e4m3)"
            )
        if self.calibrate_kv_scales < 0:
            raise ConfigError(f"calibrate_kv_scales={self.calibrate_kv_scales}: must be >= 0")
        if self.calibrate_kv_scales and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"calibrate_kv_scales={self.calibrate_kv_scales}: not supported with "
                "tensor_parallel_size > 1 yet (the checkpoint's K/V scales, or 1.0, are)"
            )
        if self.calibrate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ConfigError(
                f"calibrate_kv_scales={self.calibrate_kv_scales}: needs kv_cache_dtype fp8"
            )
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(
                f"device={short_repr(self.device)}: expected auto, cpu, cuda or cuda:N"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size}: must be a power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks}: must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]"
            )
        if not 0 < self.cpu_kv_cache_gb < math.inf:  # NaN fails this too
            raise ConfigError(
                f"cpu_kv_cache_gb={self.cpu_kv_cache_gb}: must be a finite number > 0"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")
        if self.structured_output_threads is not None and self.structured_output_threads < 1:
            raise ConfigError(
                f"structured_output_threads={self.structured_output_threads}: must be >= 1"
            )
        if self.admission_interval < 1:
            raise ConfigError(f"admission_interval={self.admission_interval}: must be >= 1")
        chunk = self.mixed_chunk_tokens
        if chunk is not None and not 0 <= chunk <= self.max_num_batched_tokens:
            raise ConfigError(
                f"mixed_chunk_tokens={chunk}: must be between 0 (off) and "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, or null (auto)"
            )
        if self.cpu_threads is not None and (
            not isinstance(self.cpu_threads, int) or self.cpu_threads < 1
        ):
            raise ConfigError(f"cpu_threads={short_repr(self.cpu_threads)}: must be >= 1 or null")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2")

    @classmethod
    def option_names(cls) -> list[str]:
        """Names accepted as engine options (job file `model:` keys and LLM kwargs)."""
        return [f.name for f in fields(cls)]
