"""Our models compute what transformers computes, loaded from the same directory."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.layers.context import AttentionContext
from batchgen.models.loader import load_model

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPTS = [
    "The committee measured the annual budget.",
    "Summarize:",
    "Our team reviewed the survey results in great detail before the deadline, on Monday.",
    "A quiet morning",
]


def hf_model(path: str):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ragged_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionContext.for_prompts([len(p) for p in prompts]))
        return model.compute_logits(hidden)  # [T, V]


def assert_logits_match(path: str, fold_norms: bool = False, kn_weights: bool = False) -> None:
    model, _ = load_model(path, "float32", "cpu")
    if fold_norms:
        assert model.fold_norms_() == model.can_fold_norms()
    if kn_weights:
        model.kn_weights_()
    ref_model = hf_model(path)
    from batchgen.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    ours = ragged_logits(model, prompts)
    with torch.no_grad():
        ref = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in prompts])
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers_on_ragged_batch(tiny_model_dir, arch):
    assert_logits_match(tiny_model_dir(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_folded_norms_logits_equal_transformers(tiny_model_dir, arch):
    # RMSNorm weights folded into qkv / gate_up, rows scaled after them, residual adds in the
    # o / down GEMMs: the same function (Qwen2's biased qkv is never folded).
    assert_logits_match(tiny_model_dir(arch), fold_norms=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_kn_weights_logits_equal_transformers(tiny_model_dir, arch):
    # gate_up, down and an untied lm_head stored K-major (and norms folded, as the GPU runs).
    assert_logits_match(tiny_model_dir(arch), fold_norms=True, kn_weights=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kn_weights_change_the_layout_only(tiny_model_dir, arch):
    model, _ = load_model(tiny_model_dir(arch), "float32", "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    embed = model.model.embed_tokens.weight.stride()
    model.kn_weights_()
    model.kn_weights_()  # idempotent
    kn = set()
    for name, param in model.named_parameters():
        assert param.shape == before[name].shape and torch.equal(param, before[name]), name
        if param.dim() == 2 and param.stride() == (1, param.shape[0]):
            kn.add(name.rsplit(".", 2)[-2])
    tied = model.config.tie_word_embeddings
    assert kn == (
        {"gate_up_proj", "down_proj"} if tied else {"gate_up_proj", "down_proj", "lm_head"}
    )
    assert model.model.embed_tokens.weight.stride() == embed  # a tied lm_head is the embedding


def test_fold_norms_is_idempotent_and_refused_with_biases(tiny_model_dir):
    model, _ = load_model(tiny_model_dir("llama"), "float32", "cpu")
    assert not model.norms_folded
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert model.fold_norms_() and model.norms_folded
    once = model.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert not torch.equal(once, qkv)  # the tiny model's norm weights are not ones
    assert model.fold_norms_()
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, once)
    qwen2, _ = load_model(tiny_model_dir("qwen2"), "float32", "cpu")
    assert not qwen2.fold_norms_() and not qwen2.norms_folded


@pytest.mark.parametrize("fold_norms", [True, False], ids=["folded", "unfolded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_equals_transformers(tiny_model_dir, arch, fold_norms):
    path = tiny_model_dir(arch)
    ref_model = hf_model(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256, fold_norms=fold_norms)
    assert llm.engine.runner.model.norms_folded == (fold_norms and arch != "qwen2")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = ref_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
        assert out.token_ids == ref.tolist()
        assert out.finish_reason == ("stop" if len(out.token_ids) < 32 else "length")


def _rewrite_config(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    edit(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_llama3_rope_scaling_published_dialect(tiny_model_dir, tmp_path):
    def edit(config):
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }

    assert_logits_match(_rewrite_config(tiny_model_dir("llama"), tmp_path / "m", edit))


def test_transformers5_rope_parameters_dialect_loads_the_same(tiny_model_dir, tmp_path):
    def edit(config):
        theta = config.pop("rope_theta")
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}

    path = _rewrite_config(tiny_model_dir("qwen3"), tmp_path / "m", edit)
    from batchgen.models.config import ModelConfig

    a, b = ModelConfig.from_dir(path), ModelConfig.from_dir(tiny_model_dir("qwen3"))
    assert a == b
    assert_logits_match(path)


def test_rope_parameters_llama3_equals_published_llama3(tiny_model_dir, tmp_path):
    scaling = {
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }

    def published(config):
        config["rope_scaling"] = {"type": "llama3", **scaling}

    def new_style(config):
        config["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": config.pop("rope_theta"),
            **scaling,
        }

    from batchgen.models.config import ModelConfig

    a = ModelConfig.from_dir(_rewrite_config(tiny_model_dir("llama"), tmp_path / "a", published))
    b = ModelConfig.from_dir(_rewrite_config(tiny_model_dir("llama"), tmp_path / "b", new_style))
    assert a == b
    assert a.rope_scaling["rope_type"] == "llama3"
