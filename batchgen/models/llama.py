"""The Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3) over a ragged token batch.

The architectures differ only in switches carried by ModelConfig: q/k/v (and o) biases (Qwen2,
Llama's attention_bias), q/k RMSNorm over head_dim (Qwen3), rope scaling and tied embeddings.
Projections are fused at load time: q/k/v into qkv_proj, gate/up into gate_up_proj.

Tensor parallel (a TensorParallel given): each rank builds its share (distributed/partition.py):
its query and KV heads in qkv_proj (fused [q, k, v] of its own heads), its columns of gate_up,
the matching input columns of o and down, whose partial outputs one all-reduce each sums, and
its rows of the vocabulary in the embedding and the LM head (logits gathered on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from batchgen.kernels import ops
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.distributed.layers import VocabParallelEmbedding, reduce_rows
from batchgen.distributed.partition import Partition, RowBlock
from batchgen.layers.activation import SiluAndMul
from batchgen.layers.attention import Attention
from batchgen.layers.context import AttentionContext
from batchgen.layers.linear import add_linear_, linear, linear_out_
from batchgen.layers.norm import RMSNorm
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        part: Partition,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = part.num_heads  # this rank's heads (all of them without tp)
        self.num_kv_heads = part.num_kv_heads
        self.tp = tp
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary_emb = rotary_emb  # one module (one cos/sin table) shared by every layer
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: AttentionContext,
        rms_eps: float | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] -> attention output [T, H].

        rms_eps given (norms folded, see LlamaForCausalLM.fold_norms_): hidden is the
        un-normalised residual stream, the input norm's weight sits in qkv_proj, and the row
        scale 1 / RMS(hidden) is applied to the qkv rows (in rope_and_store_kv on the cache
        path). The o projection is then added into hidden in place and the sum returned
        (_output_projection).
        """
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj.weight, self.qkv_proj.bias)  # [T, (Hq + 2 Hk) * D]
        folded = rms_eps is not None
        if ctx.kv_caches is None:
            if folded:
                qkv = ops.rms_scale_rows(qkv, hidden, rms_eps)
            q, k, v = self._split_norm_rope(positions, qkv)
            out = self.attn(q, k, v, ctx)  # [T, Hq, D]
        else:
            # Row scale, q/k-norm, rotary and the cache write of k/v in one kernel on GPU.
            k_cache, v_cache = ctx.kv_caches[self.attn.layer_idx]
            norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            q = ops.rope_and_store_kv(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.num_heads, self.num_kv_heads,
                k_cache, v_cache, ctx.slot_mapping, *norms,
                self.q_norm.eps if self.qk_norm else 1e-6,
                rms_rows=hidden if folded else None, rms_eps=rms_eps if folded else 1e-6,
                kv_scale=self.attn.cache_scale(k_cache),
            )  # fmt: skip
            out = self.attn.attend(q, ctx)  # [T, Hq, D]
        out = out.reshape(num_tokens, self.q_size)
        return _output_projection(hidden if folded else None, out, self.o_proj, self.tp)

    def _split_norm_rope(self, positions: torch.Tensor, qkv: torch.Tensor):
        """The cache-free path (plain forwards): qkv -> rotated q [T, Hq, D], k [T, Hk, D], v."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        if self.qk_norm:
            # Qwen3 normalizes each head vector: flatten heads into rows, [T * H, D].
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, -1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, part: Partition, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        inter = part.intermediate_size  # this rank's columns (all of them without tp)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()
        self.tp = tp

    def forward(self, hidden: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
        """[T, H] -> [T, 2I] -> [T, I] -> [T, H]. rms_eps given (norms folded): hidden is the
        un-normalised residual stream, scaled by 1 / RMS inside SiLU-and-mul, and the down
        projection is added into hidden in place and the sum returned (_output_projection)."""
        gate_up = linear(hidden, self.gate_up_proj.weight, self.gate_up_proj.bias)
        if rms_eps is None:
            return _output_projection(None, self.act_fn(gate_up), self.down_proj, self.tp)
        act = self.act_fn(gate_up, rms_rows=hidden, rms_eps=rms_eps)
        return _output_projection(hidden, act, self.down_proj, self.tp)


def _output_projection(
    residual: torch.Tensor | None, x: torch.Tensor, proj: nn.Linear, tp: TensorParallel | None
) -> torch.Tensor:
    """proj(x) [T, H] for o / down; with a residual (folded norms), residual + proj(x) computed
    in place by the GEMM itself (beta = 1), so no add kernel runs between the projection and the
    next one.

    Tensor parallel: each rank's x holds its heads / columns, so its product is a partial sum;
    one all-reduce adds them. Folded, rank 0 adds its partial into the residual stream and the
    other ranks overwrite their copy of it with theirs (beta = 0), so the sum carries the
    residual once. The bias, held whole by every rank, is added after the sum.
    Returns the result (residual itself, or a new tensor).
    """
    if tp is None and residual is None:
        return linear(x, proj.weight, proj.bias)
    if tp is not None and residual is None:
        return reduce_rows(tp, linear(x, proj.weight), proj.bias)
    if tp is None or tp.rank == 0:
        add_linear_(residual, x, proj.weight)
    else:
        linear_out_(residual, x, proj.weight)
    if tp is not None:
        return reduce_rows(tp, residual, proj.bias)
    if proj.bias is not None:
        residual.add_(proj.bias)
    return residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        part: Partition,
        mlp: nn.Module,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, part, tp)
        self.mlp = mlp  # LlamaMLP, or a mixture-of-experts block (models/moe_decoder.py)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norms_folded = False  # set by LlamaForCausalLM.fold_norms_

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.norms_folded:
            # hidden is the residual stream; both norms sit in the next projections' weights and
            # both residual adds in the o / down GEMMs: no norm or add kernel in the layer.
            eps = self.input_layernorm.eps
            hidden = self.self_attn(positions, hidden, ctx, rms_eps=eps)
            return self.mlp(hidden, rms_eps=self.post_attention_layernorm.eps), None
        # The residual stream is carried separately so the add fuses into the next RMSNorm.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        part: Partition,
        mlp_block: Callable[[int], nn.Module],
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(part, config.hidden_size, tp)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(config, i, rotary_emb, part, mlp_block(i), tp)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        if residual is None:  # folded layers leave the whole stream in hidden
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `compute_logits` projects chosen rows.

    `packed_modules` tells the loader how Hugging Face tensors fuse into our parameters:
    HF name fragment -> (our fragment, shard index) in the order of the fused rows.
    """

    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # This rank's share (rank 0 of 1: everything); raises ConfigError where tp cannot split.
        self.part = Partition.of(config, tp.rank, tp.size) if tp else Partition.of(config)
        self.model = LlamaModel(config, self.part, self.mlp_block, tp)
        self.lm_head = nn.Linear(config.hidden_size, self.part.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def mlp_block(self, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer layer_idx (mixture-of-experts models override this)."""
        return LlamaMLP(self.config, self.part, self.tp)

    def shard_sizes(self, fused: str) -> list[int]:
        """Row counts of the pieces stacked into a fused projection, in order (this rank's)."""
        p = self.part
        if fused == "qkv_proj":
            kv = p.num_kv_heads * p.head_dim
            return [p.num_heads * p.head_dim, kv, kv]
        return [p.intermediate_size, p.intermediate_size]

    def tp_slice(self, hf_name: str) -> tuple[int, RowBlock] | None:
        """The part of checkpoint tensor `hf_name` this rank loads: (dim, block), or None for
        the whole tensor (without tensor parallel; norms; o / down biases)."""
        return None if self.tp is None else weight_block(self.part, hf_name)

    @property
    def norms_folded(self) -> bool:
        return self.model.layers[0].norms_folded if len(self.model.layers) else False

    def can_fold_norms(self) -> bool:
        """Folding needs bias-free qkv and gate_up projections (a bias is added after the
        row scale, which would scale it too) with 16-bit weights (an FP8 weight times the norm
        weight would need quantizing again; a norm weight does not fold into 4-bit group
        scales)."""
        if not self.model.layers or self.config.qkv_bias or self.config.mlp_bias:
            return False
        # A checkpoint may quantize some projections only (its ignore list): check each.
        return all(
            plain_weight(layer.self_attn.qkv_proj.weight)
            and plain_weight(layer.mlp.gate_up_proj.weight)
            for layer in self.model.layers
        )

    @torch.no_grad()
    def fold_norms_(self) -> bool:
        """Fold each layer's two RMSNorm weights into the projections they feed, in place.

        norm(x) @ W.T equals (x @ (W * weight).T) scaled row by row by 1 / RMS(x); the
        kernels after the projections (rope_and_store_kv, silu_and_mul) apply that scale, and
        the o / down projections add into the residual stream themselves. A decode step then
        runs no norm or residual-add kernel inside a layer (two launches fewer per layer).
        The product W * weight is rounded once to the weights' dtype: outputs agree with the
        unfolded model to rounding, not bit for bit. `to_hf_state_dict` divides it back out.

        Returns whether the model is folded (False for biased qkv / gate_up projections).
        """
        if self.norms_folded:
            return True
        if not self.can_fold_norms():
            return False
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            # [N, H] * [H]: the norm weight scales the projection's input columns.
            attn.qkv_proj.weight.mul_(layer.input_layernorm.weight)
            mlp.gate_up_proj.weight.mul_(layer.post_attention_layernorm.weight)
            layer.norms_folded = True
        return True

    # The projections kn_weights_ stores K-major: the wide ones (llama3.1-8b's gate_up is
    # 4096 -> 28672, lm_head 4096 -> 128256) and down.
    KN_WEIGHTS = ("gate_up_proj", "down_proj", "lm_head")

    @torch.no_grad()
    def kn_weights_(self) -> None:
        """Store the KN_WEIGHTS projections' weights K-major, in place: each [N, K] weight keeps
        its shape and values, but its memory becomes that of W.T ([K, N], row-major), so
        F.linear / addmm hand cuBLAS an NN product instead of a TN one.

        On the H100, cuBLAS's kernels for the NN product stream these weights faster at decode
        sizes (gate_up at 32 rows in 80.5 us against 87.1, 2.92 TB/s of weights). In same-call
        A/Bs nano ran 0-1% faster on llama3.1-8b (three) and 2% on qwen3-0.6b (one; 2026-11-23,
        9ce2930, examples/benchmarks/RESULTS.md). qkv and o lost a little that way, so they
        stay N-major. A tied lm_head is left alone: it is the embedding table,
        which is gathered by rows. Products may round differently (another kernel), as with any
        change of GEMM kernel.
        """
        for name, module in self.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in self.KN_WEIGHTS:
                continue
            if leaf == "lm_head" and self.config.tie_word_embeddings:
                continue
            weight = module.weight
            if not plain_weight(weight):
                continue  # FP8: the GEMM takes the TN layout only; 4-bit: its packed layout
            if weight.dim() == 2 and weight.stride(0) != 1:  # not K-major yet
                weight.data = weight.data.t().contiguous().t()  # [N, K] with strides (1, N)

    def projection_groups(self) -> list[tuple[list[torch.Tensor], bool]]:
        """The decoder's projections for layers.linear.tune_projections: per projection, its
        weight in every layer and whether the model adds it into the residual stream (o and
        down with folded norms). Projections with a bias, FP8 or 4-bit weights are left out."""
        groups = []
        for attr, path in (("qkv_proj", "self_attn"), ("o_proj", "self_attn"),
                           ("gate_up_proj", "mlp"), ("down_proj", "mlp")):  # fmt: skip
            mods = [getattr(getattr(layer, path), attr) for layer in self.model.layers]
            if any(m.bias is not None or not plain_weight(m.weight) for m in mods):
                continue  # torch runs biased projections; FP8 / 4-bit ones their own kernels
            # Folded, o / down add into the residual stream; on tensor-parallel ranks but the
            # first they overwrite their copy of it instead (_output_projection).
            first = self.tp is None or self.tp.rank == 0
            accumulate = attr in ("o_proj", "down_proj") and self.norms_folded and first
            groups.append(([m.weight for m in mods], accumulate))
        return groups

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, H] -> logits [N, V]. Tensor parallel: every rank computes its vocabulary
        rows' logits [N, V / N_ranks]; rank 0 gets them all, the other ranks None."""
        logits = self.lm_head(hidden)
        if self.tp is None:
            return logits
        return self.tp.gather_columns(logits)


def plain_weight(weight: torch.Tensor) -> bool:
    """A 16- or 32-bit float weight: not FP8 (itemsize 1), not a 4-bit layer's packed int32."""
    return weight.is_floating_point() and weight.itemsize >= 2


# Hugging Face module -> the rows of its weight (dim 0) or columns (dim 1) a rank holds.
_COLUMN_PARALLEL = {
    "q_proj": Partition.q_rows,
    "k_proj": Partition.kv_rows,
    "v_proj": Partition.kv_rows,
    "gate_proj": Partition.intermediate_rows,
    "up_proj": Partition.intermediate_rows,
    "embed_tokens": Partition.vocab_rows,
    "lm_head": Partition.vocab_rows,
}
_ROW_PARALLEL = {"o_proj": Partition.q_rows, "down_proj": Partition.intermediate_rows}


def weight_block(part: Partition, hf_name: str) -> tuple[int, RowBlock] | None:
    """The (dim, block) of checkpoint tensor `hf_name` rank `part` holds: rows (dim 0) of the
    column-parallel projections' weights and biases, the embedding and the LM head; columns
    (dim 1) of the row-parallel o / down weights; None for the whole tensor (norms; o / down
    biases)."""
    parts = hf_name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2:]
    if module in _COLUMN_PARALLEL:
        return 0, _COLUMN_PARALLEL[module](part)
    if module in _ROW_PARALLEL and kind == "weight":
        return 1, _ROW_PARALLEL[module](part)
    return None
