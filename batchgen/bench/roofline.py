"""Roofline of a workload: the decode bytes model and the prefill FLOPs model of the
benchmark spec (examples/benchmarks/README.md).

Both are ideal times on the measured ceilings, with all requests resident:

- decode (bytes): decode steps t = 1 .. max(max_tokens) run in lock-step; each reads every
  weight once (all parameter bytes, a tied embedding once) plus the KV of every sequence still
  generating, of context prompt_i + t - 1 tokens:
      T_decode = (max_i m_i * W + kv_bytes_per_token * sum_i (m_i p_i + m_i (m_i - 1) / 2)) / BW
  (kv_bytes_per_token = 2 x layers x kv_heads x head_dim x the KV dtype's bytes: 2 for bf16, 1
  for an FP8 cache; W counts each weight in its stored dtype, FP8 weights 1 byte plus their
  scales). This reproduces the `nano` limits of examples/benchmarks/README.md (about 26,600
  output tok/s for qwen3-0.6b at 3.0 TB/s in bf16).
- FLOPs: every token the ideal engine runs costs 2 x non-embedding params plus attention
  4 x layers x heads x head_dim x position. Prefill runs each prompt once, minus the prefix an
  earlier request shares; scoring runs each candidate after its prompt; decode runs m_i - 1
  fed-back tokens at positions p_i .. p_i + m_i - 2.
      MFU = model FLOPs / wall time / measured matmul FLOP/s (also vs the nominal 775 TFLOP/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.bench.workloads import Workload

# bf16 dense matmul 8192^3, measured on the H100 (examples/benchmarks/README.md).
NOMINAL_H100_FLOPS = 775e12


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    head_dim: int
    non_embedding_params: int
    weight_bytes: int  # all unique parameter bytes
    kv_bytes_per_token: int  # K and V of all layers for one token, in the KV dtype

    def attention_flops(self, start: int, count: int) -> float:
        """4 x L x H x D x position, summed over positions start .. start + count - 1."""
        positions = count * start + count * (count - 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * positions

    def forward_flops(self, start: int, count: int) -> float:
        """FLOPs of running `count` tokens at positions start .. start + count - 1."""
        if count <= 0:
            return 0.0
        return 2.0 * self.non_embedding_params * count + self.attention_flops(start, count)


def model_shape(
    model_config,
    non_embedding_params: int,
    weight_bytes: int,
    kv_itemsize: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
):
    """The shape the roofline costs. Tensor parallel: pass one rank's parameters, bytes and
    heads (default: the config's), for the per-rank roofline (all-reduces not counted)."""
    c = model_config
    kv_heads = num_kv_heads or c.num_key_value_heads
    kv = 2 * c.num_hidden_layers * kv_heads * c.head_dim * kv_itemsize
    return ModelShape(
        c.num_hidden_layers,
        num_heads or c.num_attention_heads,
        c.head_dim,
        non_embedding_params,
        weight_bytes,
        kv,
    )


@dataclass(frozen=True)
class WorkloadCost:
    prefill_flops: float  # prompts (and score candidates)
    decode_flops: float
    decode_bytes: float  # the decode bytes model's total bytes
    decode_steps: int

    @property
    def flops(self) -> float:
        return self.prefill_flops + self.decode_flops


def workload_cost(shape: ModelShape, w: Workload) -> WorkloadCost:
    prefill = 0.0
    for p, shared in zip(w.prompts, w.shared_prefix_lens or [0] * w.num_requests):
        prefill += shape.forward_flops(shared, len(p) - shared)
    for p, cands in zip(w.prompts, w.candidates or []):
        prefill += sum(shape.forward_flops(len(p), len(c)) for c in cands)
    decode = sum(shape.forward_flops(len(p), m - 1) for p, m in zip(w.prompts, w.max_tokens))
    steps = max(w.max_tokens, default=0)
    kv_tokens = sum(m * len(p) + m * (m - 1) / 2 for p, m in zip(w.prompts, w.max_tokens))
    decode_bytes = steps * shape.weight_bytes + shape.kv_bytes_per_token * kv_tokens
    return WorkloadCost(prefill, decode, decode_bytes, steps)


def roofline_metrics(
    cost: WorkloadCost,
    wall_s: float,
    output_tokens: int,
    matmul_flops: float,
    copy_bytes_per_s: float,
) -> dict[str, float | None]:
    """Ideal times on the measured ceilings and the run's fraction of them."""
    decode_s = cost.decode_bytes / copy_bytes_per_s if cost.decode_steps else 0.0
    prefill_s = cost.prefill_flops / matmul_flops
    achieved = cost.flops / wall_s if wall_s > 0 else 0.0
    out: dict[str, float | None] = {
        "model_tflops": cost.flops / 1e12,
        "prefill_tflops": cost.prefill_flops / 1e12,
        "decode_gbytes": cost.decode_bytes / 1e9,
        "ideal_decode_s": decode_s,
        "ideal_prefill_s": prefill_s,
        "roofline_output_tok_s": output_tokens / decode_s if decode_s else None,
        # The targets (examples/benchmarks/README.md): output tok/s over the decode bytes model's.
        "roofline_fraction": decode_s / wall_s if decode_s and wall_s > 0 else None,
        # Both models together: (ideal decode + ideal prefill) / wall.
        "roofline_fraction_combined": (decode_s + prefill_s) / wall_s if wall_s > 0 else None,
        "achieved_tflops": achieved / 1e12,
        "mfu": achieved / matmul_flops,
        "mfu_vs_nominal_775": achieved / NOMINAL_H100_FLOPS,
    }
    return out
