"""SparseMoeBlock: a mixture-of-experts MLP (router, top-k routing, fused experts) of a batch."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.layers import reduce_rows
from batchgen.kernels import ops
from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.kernels.fused_moe_fp8 import expert_scale_shapes
from batchgen.layers.fp8_linear import Fp8Scheme
from batchgen.layers.linear import linear


class FusedExperts(nn.Module):
    """The experts' weights stacked, transformers 5's in-memory layout: gate_up_proj [E, 2I, H]
    (each expert's gate rows, then its up rows) and down_proj [E, H, I]. Checkpoints store one
    tensor per expert and projection; the loader writes each into its expert's slice."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, hidden, weights, ids, touched=None, token_slots=None) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] (ops.fused_moe's arguments)."""
        return ops.fused_moe(
            hidden, self.gate_up_proj, self.down_proj, weights, ids, touched, token_slots
        )

    def warm_up(self, hidden: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> None:
        """Compile the kernels for every token count (hidden: one row of the activations)."""
        ops.fused_moe_warm_up(self.gate_up_proj, self.down_proj, top_k, weights_dtype)


class Fp8FusedExperts(nn.Module):
    """FusedExperts with FP8 e4m3 weights (kernels/fused_moe_fp8.py): gate_up_proj [E, 2I, H],
    down_proj [E, H, I] and their float32 scales, gate_up_scale and down_scale, shaped as
    `scheme` says ([E, 2I] and [E, H] per channel; block grids with block weights)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        scheme: Fp8Scheme,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.scheme = scheme
        fp8 = dict(dtype=FP8_DTYPE, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, **fp8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, **fp8), requires_grad=False)
        shapes = expert_scale_shapes(e, h, i, scheme.block)
        f32 = dict(dtype=torch.float32, device=device)
        self.register_buffer("gate_up_scale", torch.ones(shapes[0], **f32))
        self.register_buffer("down_scale", torch.ones(shapes[1], **f32))

    def forward(self, hidden, weights, ids, touched=None, token_slots=None) -> torch.Tensor:
        """As FusedExperts.forward, through the FP8 kernel."""
        return ops.fused_moe_fp8(
            hidden, self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale,
            weights, ids, self.scheme, touched, token_slots,
        )  # fmt: skip

    def warm_up(self, hidden: torch.Tensor, top_k: int, weights_dtype: torch.dtype) -> None:
        """As FusedExperts.warm_up."""
        ops.fused_moe_fp8_warm_up(
            hidden, self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale,
            top_k, weights_dtype, self.scheme,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"scheme={self.scheme}"


class ExpertCounter:
    """Distinct experts the real tokens of each MoE layer's batch reach, summed over layers and
    forwards, in a device counter (no host sync; CUDA graphs add to it on every replay).

    The benchmark's roofline counts the expert weights each step has to read from this. A token
    is real when its KV slot (token_slots, the forward's slot_mapping, set by the model before
    each forward) is >= 0: a CUDA graph's padding rows have slot -1 and are not counted.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.touched = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_slots: torch.Tensor | None = None

    def read(self) -> int:
        """The count so far (synchronizes with the device)."""
        return int(self.touched.item())


class SparseMoeBlock(nn.Module):
    """Router `gate` [E, H] and routed experts; each token goes to its top_k experts and gets
    their outputs summed with the routing weights.

    Tensor parallel (`tp` given): every rank holds the whole router, so all route alike, and
    its block of each expert's intermediate rows (I = the full width / N: gate / up rows, down
    columns, as partition.py splits them). Each rank's weighted sum over its slices is a
    partial sum of the output; one all-reduce after the down projection adds them, as after the
    dense MLP's.

    Args:
        hidden_size: H.
        num_experts: E.
        intermediate_size: I, each expert's gate/up width on this rank.
        top_k: experts per token.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        round_weights: round the routing weights to the model's dtype before they scale the
            experts' outputs (Qwen3-MoE), else scale in float32 (Mixtral).
        counter: where to count the experts the batch reaches (None: not counted).
        tp: this rank's place in a tensor-parallel group (None: one rank holds everything).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        top_k: int,
        norm_topk_prob: bool,
        round_weights: bool,
        counter: ExpertCounter | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.round_weights = round_weights
        self.counter = counter
        self.tp = tp

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (routing weights [T, K], expert ids [T, K] int32): router logits in
        the model's dtype, softmax and top-k in float32 (transformers' routers)."""
        logits = linear(hidden, self.gate.weight)  # [T, E]
        dtype = hidden.dtype if self.round_weights else torch.float32
        return ops.moe_route(logits, self.top_k, self.norm_topk_prob, dtype)

    def warm_up(self) -> None:
        """Compile this block's GPU kernels for every token count (router, alignment, GEMMs)
        before a run; nothing is counted."""
        hidden = self.gate.weight.new_zeros(1, self.gate.weight.shape[1])
        weights, _ = self.route(hidden)
        self.experts.warm_up(hidden, self.top_k, weights.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (normalised) -> the weighted sum of each token's experts [T, H]."""
        weights, ids = self.route(hidden)
        counter = self.counter
        touched = counter.touched if counter is not None else None
        slots = counter.token_slots if counter is not None else None
        # [T, H]; with tp, this rank's partial sum over its slices of the experts
        out = self.experts(hidden, weights, ids, touched, slots)
        return out if self.tp is None else reduce_rows(self.tp, out, None)
