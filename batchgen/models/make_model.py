"""`batchgen make-model`: write a deterministic, seeded tiny model in Hugging Face format."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.moe_config import CHECKPOINT_NAMES, MoeConfig
from batchgen.models.presets import TINY_PRESETS
from batchgen.models.tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS, train_tokenizer
from batchgen.models.wide_tokenizer import wide_bpe_tokenizer


def make_model(
    out_dir: str,
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    vocab_size: int | None = None,
) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json for a random tiny `arch` model into `out_dir`.

    Args:
        out_dir: target directory (created; existing model files in it are replaced).
        arch: one of llama, mistral, qwen2, qwen3, qwen3_moe, mixtral.
        preset: only "tiny" is written to disk (benchmark shapes are built on the device).
        seed: seeds the weights; the same seed gives the same tensors.
        overrides: config.json keys to change from the preset (e.g. num_key_value_heads,
            attention_bias, tie_word_embeddings: variants for tests).
        vocab_size: None: the trained 512-token tokenizer. Else a byte-level BPE of exactly
            this many tokens (wide_tokenizer.py), so work whose cost depends on the vocabulary
            (structured output's token masks) can be measured at a real model's size.
    """
    if preset != "tiny":
        raise ModelLoadError(f"preset {preset!r}: make-model writes only the 'tiny' preset")
    if arch not in TINY_PRESETS:
        raise ModelLoadError(f"arch {arch!r}: expected one of {', '.join(sorted(TINY_PRESETS))}")
    os.makedirs(out_dir, exist_ok=True)
    if vocab_size is None:
        tokenizer = train_tokenizer(seed=seed)
        # Pad the vocabulary past the tokenizer's, as real checkpoints do (ids it never emits).
        vocab = (tokenizer.get_vocab_size() + 63) // 64 * 64
    else:
        tokenizer = wide_bpe_tokenizer(vocab_size, seed=seed)
        vocab = vocab_size
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    config = {
        **TINY_PRESETS[arch],
        "vocab_size": vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        **(overrides or {}),
    }
    tensors = _random_weights(config, seed)
    write_model_dir(out_dir, config, tensors, tokenizer)


def write_model_dir(
    out_dir: str, config: dict, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> None:
    """Write a Hugging Face model directory: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (the tiny models' chat template) and generation_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(out_dir, "config.json"), config)
    write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "add_bos_token": True,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False},
    )


def write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors. Larger std than real inits (0.3 for projections, 0.5 for embeddings and
    head) so the layers matter and greedy choices are decisive rather than near-ties."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads

    def normal(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.1)

    arch = config["architectures"][0]
    qkv_bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias")
    moe = ModelConfig.from_dict(config, source="preset").moe
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, h, std=0.5)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm_weight(h)
        out[p + "post_attention_layernorm.weight"] = norm_weight(h)
        for name, rows in (
            ("q_proj", heads * d),
            ("k_proj", kv_heads * d),
            ("v_proj", kv_heads * d),
        ):
            out[p + f"self_attn.{name}.weight"] = normal(rows, h)
            if qkv_bias:
                out[p + f"self_attn.{name}.bias"] = normal(rows)
        out[p + "self_attn.o_proj.weight"] = normal(h, heads * d)
        if config.get("attention_bias"):
            out[p + "self_attn.o_proj.bias"] = normal(h)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            out[p + "self_attn.q_norm.weight"] = norm_weight(d)
            out[p + "self_attn.k_norm.weight"] = norm_weight(d)
        if moe is not None and moe.sparse_layers[i]:
            out.update(_expert_weights(config, p, moe, normal))
            continue
        out[p + "mlp.gate_proj.weight"] = normal(inter, h)
        out[p + "mlp.up_proj.weight"] = normal(inter, h)
        out[p + "mlp.down_proj.weight"] = normal(h, inter)
    out["model.norm.weight"] = norm_weight(h)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = normal(vocab, h, std=0.5)
    return {k: v.contiguous() for k, v in out.items()}


def _expert_weights(config: dict, prefix: str, moe: MoeConfig, normal) -> dict[str, torch.Tensor]:
    """A sparse layer's router and per-expert tensors under the Hub's names: Qwen3-MoE's
    mlp.experts.{e}.gate_proj / up_proj / down_proj, Mixtral's block_sparse_moe.experts.{e}.w1
    (gate) / w3 (up) / w2 (down). A router std of 1 keeps the top-k choices decisive."""
    h, inter = config["hidden_size"], moe.intermediate_size
    block, (gate, up, down) = CHECKPOINT_NAMES[config["architectures"][0]]
    block = f"{prefix}{block}."
    out = {block + "gate.weight": normal(moe.num_experts, h, std=1.0)}
    for e in range(moe.num_experts):
        out[f"{block}experts.{e}.{gate}.weight"] = normal(inter, h)
        out[f"{block}experts.{e}.{up}.weight"] = normal(inter, h)
        out[f"{block}experts.{e}.{down}.weight"] = normal(h, inter)
    return out
