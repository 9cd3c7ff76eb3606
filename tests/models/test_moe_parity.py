"""Mixture-of-experts models (Qwen3-MoE, Mixtral) written by transformers load and compute what
transformers computes: logits on a ragged batch, greedy continuations, also through the engine's
prefix cache and preemption."""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open

from batchgen import LLM, SamplingParams
from batchgen.layers.context import AttentionContext
from batchgen.layers.moe import SparseMoeBlock
from batchgen.models.loader import load_model
from batchgen.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VARIANTS = ["qwen3_moe", "qwen3_moe_step2", "mixtral"]
# Which decoder layers are sparse in each variant (transformers' own rule, spelled out).
SPARSE_LAYERS = {
    "qwen3_moe": [True, False, True],  # mlp_only_layers=[1]
    "qwen3_moe_step2": [False, True, False, True],  # decoder_sparse_step=2
    "mixtral": [True, True],
}
PROMPTS = [
    "The committee measured the annual budget.",
    "Summarize:",
    "Our team reviewed the survey results in great detail before the deadline, on Monday.",
    "A quiet morning",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def hf_model(path: str):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def saved_keys(path: str) -> set[str]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_transformers_saves_the_hubs_per_expert_names(tiny_moe_dir):
    # transformers 5 holds experts fused in memory and writes one tensor per expert on save,
    # as the Hub's checkpoints are laid out.
    qwen = saved_keys(tiny_moe_dir("qwen3_moe"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert {f"model.layers.0.mlp.experts.{e}.{proj}.weight" for e in range(8)} <= qwen
        assert f"model.layers.1.mlp.{proj}.weight" in qwen  # the dense layer
    assert "model.layers.0.mlp.gate.weight" in qwen
    assert not any("gate_up_proj" in k or "layers.1.mlp.experts" in k for k in qwen)
    mixtral = saved_keys(tiny_moe_dir("mixtral"))
    for w in ("w1", "w2", "w3"):
        assert {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4)} <= (
            mixtral
        )
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral
    assert not any(".mlp." in k or "gate_up_proj" in k for k in mixtral)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_on_ragged_batch(tiny_moe_dir, variant):
    model, ref_model = assert_logits_match(tiny_moe_dir(variant), SPARSE_LAYERS[variant])
    # Every expert of the first sparse layer holds its own checkpoint tensors.
    layer = SPARSE_LAYERS[variant].index(True)
    experts = ref_model.model.layers[layer].mlp.experts
    mine = model.model.layers[layer].mlp.experts
    assert torch.equal(mine.gate_up_proj, experts.gate_up_proj)
    assert torch.equal(mine.down_proj, experts.down_proj)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_make_model_writes_moe_checkpoints_transformers_reads(tiny_model_dir, arch):
    # `batchgen make-model --arch qwen3_moe|mixtral`: the Hub's per-expert names, which
    # transformers loads into the same model as ours.
    path = tiny_model_dir(arch)
    keys = saved_keys(path)
    expert = "mlp.experts.7.up_proj" if arch == "qwen3_moe" else "block_sparse_moe.experts.3.w3"
    assert f"model.layers.0.{expert}.weight" in keys
    assert_logits_match(path, [True, False] if arch == "qwen3_moe" else [True, True])


def assert_logits_match(path: str, sparse_layers: list[bool]):
    """Our fp32 logits of PROMPTS as one ragged batch equal transformers' within 1e-4; returns
    (our model, transformers' model)."""
    model, config = load_model(path, "float32", "cpu")
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == sparse_layers == list(config.moe.sparse_layers)
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionContext.for_prompts([len(p) for p in prompts]))
        ours = model.compute_logits(hidden)
        ref_model = hf_model(path)
        ref = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in prompts])
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    return model, ref_model


@pytest.fixture(scope="module")
def references(tiny_moe_dir):
    """transformers' 32-token greedy continuation of each prompt alone, per variant."""
    cache: dict[str, list[list[int]]] = {}

    def get(variant: str, prompts: list[list[int]]) -> list[list[int]]:
        key = f"{variant}:{hash(tuple(map(tuple, prompts)))}"
        if key not in cache:
            hf = hf_model(tiny_moe_dir(variant))
            with torch.no_grad():
                cache[key] = [
                    hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[
                        0, len(p) :
                    ].tolist()
                    for p in prompts
                ]
        return cache[key]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_continuation_equals_transformers(tiny_moe_dir, references, variant):
    path = tiny_moe_dir(variant)
    llm = LLM(path, dtype="float32", num_kv_blocks=128, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == references(variant, prompts)
    # The experts the batches reached were counted (at least top_k per sparse layer a step).
    moe = llm.engine.runner.model_config.moe
    steps = llm.stats.num_steps
    assert llm.engine.runner.model.expert_counter.read() >= steps * moe.num_sparse_layers


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Ten prompts, the first eight sharing a 40-token prefix (BOS first)."""
    rng = random.Random(seed)
    prefix = [0] + [rng.randrange(5, 500) for _ in range(40)]
    shared = [
        prefix + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 30))] for _ in range(8)
    ]
    return shared + [[0] + [rng.randrange(5, 500) for _ in range(n)] for n in (60, 7)]


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_greedy_equals_transformers_with_prefix_cache_and_preemption(
    tiny_moe_dir, references, variant
):
    # 14 blocks of 8 tokens for 10 requests of up to 102 tokens: a few run at a time, the rest
    # are preempted and recomputed; the shared prefix is served from the cache.
    path = tiny_moe_dir(variant)
    prompts = shared_prefix_prompts(seed=11)
    llm = LLM(
        path, dtype="float32", max_model_len=128, num_kv_blocks=16, block_size=8,
        enable_prefix_caching=True,
    )  # fmt: skip
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.stats.num_preemptions > 0
    assert llm.stats.num_cached_tokens > 0
    assert [o.token_ids for o in outs] == references(variant, prompts)
