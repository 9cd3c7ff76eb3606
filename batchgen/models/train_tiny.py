"""Train a tiny Llama on CPU: a plain-torch Llama with Hugging Face parameter names (the same math
as transformers' LlamaForCausalLM with tied embeddings), next-token cross-entropy, AdamW, seeded.

Used by the `trained-tiny` preset of `batchgen make-model` (batchgen/models/trained_tiny.py);
the engine never imports it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int  # sequences a step
    seq_len: int  # tokens a sequence (the targets are the next seq_len tokens)
    lr: float
    warmup_steps: int
    weight_decay: float
    seed: int


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, neox style (halves rotated), x [B, H, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim = (
            c["num_attention_heads"],
            c["num_key_value_heads"],
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = _RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class TrainableLlama(nn.Module):
    """LlamaForCausalLM with tied embeddings; state_dict() has Hugging Face's names."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        if not config.get("tie_word_embeddings"):
            raise ValueError("TrainableLlama ties the LM head to the embeddings")
        self.model = _Decoder(config)
        d, theta = config["head_dim"], config["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]."""
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)  # [T, D]
        cos, sin = angles.cos(), angles.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.t()

    @torch.no_grad()
    def init_weights_(self, seed: int) -> None:
        """normal(0, 0.02), the residual outputs (o, down) by another 1 / sqrt(2 layers), as
        GPT-2 does so the residual stream's variance does not grow with depth; norms ones."""
        gen = torch.Generator().manual_seed(seed)
        depth = len(self.model.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = (
                0.02 / math.sqrt(2 * depth)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else 0.02
            )
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def train(
    model: TrainableLlama,
    tokens: torch.Tensor,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train in place on random windows of `tokens` [N] int64 (drawn from a seeded generator).

    Returns:
        The log: every 10th step's {step, loss, lr, seconds}.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    offsets = torch.arange(cfg.seq_len + 1)
    history: list[dict] = []
    start = time.monotonic()
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size, 1), generator=gen)
        batch = tokens[starts + offsets]  # [B, T + 1]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == cfg.steps - 1:
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "lr": _lr_at(step, cfg),
                "seconds": round(time.monotonic() - start, 1),
            }
            history.append(entry)
            log(f"step {step}/{cfg.steps}: loss {entry['loss']:.4f} ({entry['seconds']:.0f} s)")
    model.eval()
    return history


@torch.no_grad()
def heldout_loss(model: TrainableLlama, tokens: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss of every token after the first, over consecutive windows of
    seq_len targets (each window starts without context): a check of training, independent of
    the engine's perplexity."""
    total, count = 0.0, 0
    for lo in range(0, len(tokens) - 1, seq_len):
        window = tokens[lo : lo + seq_len + 1][None]
        if window.shape[1] < 2:
            break
        logits = model(window[:, :-1])
        total += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return total / count
