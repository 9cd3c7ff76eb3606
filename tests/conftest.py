"""Shared fixtures: tiny HF-format models written once per test session by `make_model`, and a
cache directory of the test session's own."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests need a CUDA device; deselecting keeps CPU runs honest (nothing silently passes).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    # Digests, GEMM tunings and crash reports of tests go to a directory of the test session,
    # never the user's ~/.cache/batchgen (a test that needs its own sets the variable again).
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("llama") -> path of a seeded tiny model of that architecture."""
    from batchgen.models.make_model import make_model

    made: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_model(str(path), arch, "tiny", seed=0)
            made[arch] = str(path)
        return made[arch]

    return get


# Tiny mixture-of-experts checkpoints written by transformers itself (its config classes,
# save_pretrained), each a variant of the published layouts.
MOE_VARIANTS = {
    # Qwen3-MoE with a dense layer in the middle (mlp_only_layers) and renormalised top-k.
    "qwen3_moe": dict(
        cls="Qwen3Moe", num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # Every second layer sparse (decoder_sparse_step), raw top-k probabilities, top-3.
    "qwen3_moe_step2": dict(
        cls="Qwen3Moe", num_hidden_layers=4, head_dim=16, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=24, intermediate_size=80, decoder_sparse_step=2,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        cls="Mixtral", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=64,
    ),
    # qwen3_moe with every fused dense projection's parts whole 128-row blocks (FP8 blocks).
    "qwen3_moe_blocks": dict(
        cls="Qwen3Moe", num_hidden_layers=3, head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, intermediate_size=128, mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
}  # fmt: skip


def make_moe_checkpoint(path: str, variant: str, tokenizer_dir: str, seed: int = 0) -> None:
    """Write a tiny MoE model with transformers (random weights, larger than its init so the
    experts and the router matter) beside a copy of a tiny model's tokenizer."""
    import json
    import os
    import shutil

    import transformers

    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        base = json.load(f)
    spec = dict(MOE_VARIANTS[variant])
    cls = spec.pop("cls")
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=base["vocab_size"], hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"],
        tie_word_embeddings=False, **spec,
    )  # fmt: skip
    config.architectures = [f"{cls}ForCausalLM"]
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:  # projections, experts and the router
                p.copy_(0.3 * noise)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_model_dir):
    """Factory: tiny_moe_dir("mixtral") -> path of a tiny MoE checkpoint (MOE_VARIANTS)."""
    made: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in made:
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            make_moe_checkpoint(str(path), variant, tiny_model_dir("llama"))
            made[variant] = str(path)
        return made[variant]

    return get
