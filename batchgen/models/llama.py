"""The Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3) over a ragged token batch.

The architectures differ only in switches carried by ModelConfig: q/k/v (and o) biases (Qwen2,
Llama's attention_bias), q/k RMSNorm over head_dim (Qwen3), rope scaling and tied embeddings.
Projections are fused at load time: q/k/v into qkv_proj, gate/up into gate_up_proj.
"""

from __future__ import annotations

import torch
from batchgen.kernels import ops
from torch import nn

from batchgen.layers.activation import SiluAndMul
from batchgen.layers.attention import Attention
from batchgen.layers.context import AttentionContext
from batchgen.layers.norm import RMSNorm
from batchgen.layers.rotary import RotaryEmbedding
from batchgen.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
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
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hk) * D]
        if ctx.kv_caches is None:
            q, k, v = self._split_norm_rope(positions, qkv)
            out = self.attn(q, k, v, ctx)  # [T, Hq, D]
        else:
            # q/k-norm, rotary and the cache write of k/v in one kernel on GPU.
            k_cache, v_cache = ctx.kv_caches[self.attn.layer_idx]
            norms = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()
            )
            q = ops.rope_and_store_kv(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.num_heads, self.num_kv_heads,
                k_cache, v_cache, ctx.slot_mapping, *norms,
            )  # fmt: skip
            out = self.attn.attend(q, ctx)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]

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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))  # [T, 2I] -> [T, I] -> [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, rotary_emb) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_sizes(self, fused: str) -> list[int]:
        """Row counts of the pieces stacked into a fused projection, in order."""
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V]."""
        return self.lm_head(hidden)
