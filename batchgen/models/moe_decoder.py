"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama-family decoder with sparse MLPs.

Attention, norms, rotary and the LM head are llama.py's; the MLP of each sparse layer
(ModelConfig.moe.sparse_layers) is a SparseMoeBlock (layers/moe.py): a router and E experts
whose weights are stacked [E, ...] so one fused kernel runs them all. Qwen3-MoE's dense layers
(mlp_only_layers, decoder_sparse_step) keep llama.py's MLP at the model's intermediate_size.

Checkpoints store each expert's projections as separate tensors (Qwen3-MoE:
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`; Mixtral:
`block_sparse_moe.experts.{e}.w1/w3/w2.weight`, w1 the gate and w3 the up projection); the
loader writes each into expert e's slice of the stacked parameters (checkpoint_name and
param_shard_sizes below; the names per architecture in moe_config.CHECKPOINT_NAMES).
Parameter names are transformers 5's in-memory ones (`mlp.gate.weight`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), so to_hf_state_dict hands transformers
our weights as they are.

RMSNorm weights are not folded into the projections here (can_fold_norms): the router and
the experts would both need the row scale.

Tensor parallel: each rank holds the whole router of every sparse layer and its block of every
expert's intermediate rows (Partition.expert_rows), read from each per-expert tensor as a
safetensors slice (tp_slice), so no process reads an expert whole; the block's output is one
all-reduce (layers/moe.py), like the dense MLP's down projection.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.partition import RowBlock
from batchgen.layers.context import AttentionContext
from batchgen.layers.moe import ExpertCounter, SparseMoeBlock
from batchgen.models.config import ModelConfig
from batchgen.models.llama import LlamaForCausalLM
from batchgen.models.moe_config import CHECKPOINT_NAMES

# model.layers.{i}.{block}.experts.{e}.{projection}.weight
_EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family causal LM whose sparse layers route each token to top_k of E experts.

    `expert_counter` counts the experts every forward's real tokens reach (for the benchmark's
    roofline; a device counter, see ExpertCounter).
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture}: a mixture-of-experts model needs config.moe")
        # Built before the layers, which share it, on the device the model is being built on.
        self.expert_counter = ExpertCounter()
        super().__init__(config, tp)
        self.kernels_warm = False  # forward compiles the MoE kernels once, before any step

    def mlp_block(self, layer_idx: int) -> nn.Module:
        moe = self.config.moe
        if not moe.sparse_layers[layer_idx]:
            return super().mlp_block(layer_idx)
        return SparseMoeBlock(
            self.config.hidden_size,
            moe.num_experts,
            self.part.expert_intermediate_size,  # this rank's rows of each expert
            moe.top_k,
            moe.norm_topk_prob,
            moe.round_weights,
            self.expert_counter,
            self.tp,
        )

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    # ---- checkpoint layout -------------------------------------------------------------------
    def _expert_tensor(self, hf_name: str) -> tuple[str, int, str] | None:
        """(layer prefix, expert, projection) of one of this model's per-expert checkpoint
        tensors; None for any other name."""
        block, projections = CHECKPOINT_NAMES[self.config.architecture]
        match = _EXPERT_TENSOR.match(hf_name)
        if match is None:
            return None
        layer, found, expert, projection = match.groups()
        e = int(expert)
        if found != block or projection not in projections or e >= self.config.moe.num_experts:
            return None
        return layer, e, projection

    def tp_slice(self, hf_name: str) -> tuple[int, RowBlock] | None:
        """The part of checkpoint tensor hf_name this rank loads. Each expert's gate and up
        projections: its block of rows (dim 0); its down projection: the matching columns
        (dim 1). The router is whole on every rank; the rest as in the Llama decoder."""
        if self.tp is None:
            return None
        expert = self._expert_tensor(hf_name)
        if expert is None:
            # Not one of this model's experts (a bad index or name): read whole, and the
            # loader reports it as unexpected.
            return None if _EXPERT_TENSOR.match(hf_name) else super().tp_slice(hf_name)
        down = CHECKPOINT_NAMES[self.config.architecture][1][2]
        return (1 if expert[2] == down else 0), self.part.expert_rows()

    def checkpoint_name(self, hf_name: str) -> tuple[str, int | None] | None:
        """Where checkpoint tensor hf_name goes when the Llama mapping does not say: expert e's
        gate / up rows are shards 2e / 2e + 1 of experts.gate_up_proj ([E * 2I, H] as rows),
        its down projection shard e of experts.down_proj ([E * H, I]); a renamed block's router
        goes to mlp.gate. None: the loader's default mapping (and its error for unknown names).
        """
        block, (gate, up, down) = CHECKPOINT_NAMES[self.config.architecture]
        expert = self._expert_tensor(hf_name)
        if expert is None:
            if _EXPERT_TENSOR.match(hf_name) is None and block != "mlp" and f".{block}." in hf_name:
                return hf_name.replace(f".{block}.", ".mlp."), None
            return None  # the default mapping, or not ours: reported as unexpected
        layer, e, projection = expert
        if projection == down:
            return f"{layer}.mlp.experts.down_proj", e
        return f"{layer}.mlp.experts.gate_up_proj", 2 * e + (projection == up)

    def param_shard_sizes(self, name: str) -> list[int] | None:
        """Row counts of the checkpoint tensors (this rank's slices of them) a stacked expert
        parameter is loaded from (None for every other parameter: the Llama fusions apply)."""
        moe, hidden = self.config.moe, self.config.hidden_size
        if name.endswith(".experts.gate_up_proj"):
            return [self.part.expert_intermediate_size] * (2 * moe.num_experts)
        if name.endswith(".experts.down_proj"):
            return [hidden] * moe.num_experts
        return None

    # ---- engine hooks ------------------------------------------------------------------------
    def can_fold_norms(self) -> bool:
        return False

    def projection_groups(self) -> list[tuple[list[torch.Tensor], bool]]:
        """The cuBLAS projections for GEMM tuning: attention's in every layer, the routers, and
        the dense layers' MLP (the experts run in the fused MoE kernel instead)."""
        layers = self.model.layers
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)]
        mods = [
            [layer.self_attn.qkv_proj for layer in layers],
            [layer.self_attn.o_proj for layer in layers],
            [block.gate for block in self.sparse_blocks()],
            [mlp.gate_up_proj for mlp in dense],
            [mlp.down_proj for mlp in dense],
        ]
        return [
            ([m.weight for m in group], False)
            for group in mods
            if group and all(m.bias is None for m in group)
        ]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        if not self.kernels_warm and input_ids.is_cuda:
            self._warm_up_kernels()
        # The experts a step reads are counted over its real tokens: those with a KV slot.
        self.expert_counter.token_slots = ctx.slot_mapping
        return super().forward(input_ids, positions, ctx)

    def _warm_up_kernels(self) -> None:
        """Compile the fused MoE kernels of every token count at the first forward on the GPU
        (the engine's memory profile), so that no step compiles one mid-run. Every sparse
        layer has the same shapes: one layer's kernels serve all."""
        if torch.cuda.is_current_stream_capturing():
            return  # never inside a CUDA graph; the capture's un-captured run comes first
        self.kernels_warm = True
        blocks = self.sparse_blocks()
        if blocks:
            blocks[0].warm_up()


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k-norm attention, 128 experts, top-8."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral (8x7B, 8x22B): Mistral attention, 8 experts, top-2, w1/w3/w2 expert names."""
