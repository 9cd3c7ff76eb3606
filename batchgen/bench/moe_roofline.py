"""Roofline of a mixture-of-experts model: a decode step reads the experts its tokens reach, not
all of them.

Two ideals on the copy ceiling, both with the dense weights (attention, routers, dense layers,
embedding and head) read once a step and the decode bytes model's KV (roofline.py):

- all resident (`roofline_fraction`): the decode steps t = 1 .. max m_i in lock-step, step t
  with n_t sequences still generating; each sparse layer reads the experts its n_t tokens are
  expected to reach under uniform routing, E (1 - (1 - K / E)^n_t).
- the steps taken (`roofline_fraction_steps_taken`): every step the run took, each reading
  the experts its real tokens did reach (counted on the device by the MoE layers,
  layers/moe.py ExpertCounter). A run whose KV cache cannot hold every sequence at once (the
  KV capacity left beside the weights) takes more steps than the lock-step ideal; this is the
  ideal of those steps.

FLOPs count the active parameters: a token runs through K of the E experts of a sparse layer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from batchgen.bench.roofline import ModelShape, WorkloadCost, workload_cost
from batchgen.bench.workloads import Workload


@dataclass(frozen=True)
class ExpertShape:
    num_sparse_layers: int
    num_experts: int
    top_k: int
    expert_params: int  # one expert's gate, up and down weights
    expert_bytes: int  # the same in the weights' dtype

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts num_tokens tokens reach in one layer under uniform routing."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)


def expert_shape(
    model_config, weight_itemsize: int, expert_intermediate_size: int | None = None
) -> ExpertShape | None:
    """The routed experts of a ModelConfig; None for a dense model.

    Args:
        expert_intermediate_size: each expert's intermediate rows on one tensor-parallel rank
            (Partition.expert_intermediate_size), for that rank's share; None for all of them.
    """
    moe = model_config.moe
    if moe is None:
        return None
    inter = expert_intermediate_size or moe.intermediate_size
    params = 3 * inter * model_config.hidden_size
    return ExpertShape(
        moe.num_sparse_layers, moe.num_experts, moe.top_k, params, params * weight_itemsize
    )


def moe_model_shape(shape: ModelShape, experts: ExpertShape) -> ModelShape:
    """shape with the FLOPs of the active parameters (K of E experts per sparse layer)."""
    idle = experts.num_sparse_layers * (experts.num_experts - experts.top_k)
    return replace(
        shape, non_embedding_params=shape.non_embedding_params - idle * experts.expert_params
    )


def dense_bytes(shape: ModelShape, experts: ExpertShape) -> int:
    """Weight bytes every step reads whatever the routing: all but the experts."""
    all_experts = experts.num_sparse_layers * experts.num_experts * experts.expert_bytes
    return shape.weight_bytes - all_experts


def kv_bytes(shape: ModelShape, w: Workload) -> float:
    """The decode bytes model's KV reads: request i at contexts p_i .. p_i + m_i - 1."""
    tokens = sum(m * len(p) + m * (m - 1) / 2 for p, m in zip(w.prompts, w.max_tokens))
    return shape.kv_bytes_per_token * tokens


def resident_cost(shape: ModelShape, experts: ExpertShape, w: Workload) -> WorkloadCost:
    """The workload's cost with the active parameters' FLOPs and, as decode bytes, the
    all-resident lock-step reading the experts each step's tokens are expected to reach."""
    cost = workload_cost(moe_model_shape(shape, experts), w)
    dense = dense_bytes(shape, experts)
    per_layer = experts.expert_bytes * experts.num_sparse_layers
    ends = Counter(w.max_tokens)
    running, weights = len(w.max_tokens), 0.0  # running: sequences with m_i >= t
    for t in range(1, cost.decode_steps + 1):
        weights += dense + per_layer * experts.expected_experts(running)
        running -= ends.get(t, 0)
    return replace(cost, decode_bytes=weights + kv_bytes(shape, w))


def steps_taken_metrics(
    shape: ModelShape,
    experts: ExpertShape,
    w: Workload,
    steps: int,
    experts_touched: int,
    wall_s: float,
    output_tokens: int,
    copy_bytes_per_s: float,
) -> dict[str, float | None]:
    """The roofline over the steps a run took (module docstring): `steps` steps each reading
    the dense weights, experts_touched expert reads in all (summed over steps and sparse
    layers), and the workload's decode KV."""
    total = steps * dense_bytes(shape, experts) + experts_touched * experts.expert_bytes
    ideal_s = (total + kv_bytes(shape, w)) / copy_bytes_per_s
    per = steps * experts.num_sparse_layers
    return {
        "experts_touched_per_layer_step": experts_touched / per if per else None,
        "ideal_steps_taken_s": ideal_s,
        "roofline_steps_taken_output_tok_s": output_tokens / ideal_s if ideal_s else None,
        "roofline_fraction_steps_taken": ideal_s / wall_s if wall_s > 0 else None,
    }
