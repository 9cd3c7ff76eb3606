"""The transformers peer: identical weights (logits match) and a CPU continuous-batching run."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.random_model import build_random_model, init_random_, preset_config
from batchgen.bench.workloads import build_workload
from batchgen.layers.context import AttentionContext
from batchgen.models.config import ModelConfig
from batchgen.models.hf_export import to_hf_state_dict
from batchgen.models.loader import build_model
from batchgen.models.presets import BENCH_PRESETS, TINY_PRESETS

pytest.importorskip("transformers")
peer_hf = pytest.importorskip("batchgen.bench.peer_hf")

CPU = torch.device("cpu")


def _ours_logits(model, ids: list[int]) -> torch.Tensor:
    ctx = AttentionContext.for_prompts([len(ids)], CPU)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ctx))


@pytest.mark.parametrize("arch", ["llama", "llama-rope3", "qwen3", "qwen2"])
def test_weight_copy_gives_the_same_logits(arch):
    if arch == "llama-rope3":  # llama3.1-8b's rope scaling on the tiny shape
        rope = {"rope_scaling": BENCH_PRESETS["llama3.1-8b"]["rope_scaling"], "rope_theta": 5e5}
        raw = {**TINY_PRESETS["llama"], **rope, "vocab_size": 512}
    else:
        raw = {**TINY_PRESETS[arch], "vocab_size": 512}
    ours = init_random_(build_model(ModelConfig.from_dict(raw), torch.float32, CPU), seed=1)
    hf = peer_hf.build_hf_model(raw, to_hf_state_dict(ours), None, torch.float32, CPU)
    ids = [(7 * i) % 512 for i in range(300)]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    ref = _ours_logits(ours, ids)
    assert ref.abs().max() > 0.05  # random weights, not zeros
    torch.testing.assert_close(theirs, ref, atol=1e-4, rtol=1e-4)


def test_continuous_batching_peer_runs_on_cpu():
    model, raw = build_random_model("tiny", torch.float32, CPU)
    hf = peer_hf.build_hf_model(raw, to_hf_state_dict(model), None, torch.float32, CPU)
    w = build_workload("nano", 512, num_prompts=3, max_output_tokens=5)
    result = peer_hf.run_peer(hf, w, None, CPU, timeout_s=600)
    assert result.requests == 3 and result.errors == 0
    assert result.output_tokens == sum(w.max_tokens)  # per-request lengths, EOS disabled


def test_hf_state_dict_unfuses_projections():
    model, _ = build_random_model("tiny", torch.float32, CPU)
    sd = to_hf_state_dict(model)
    assert "model.layers.0.self_attn.q_proj.weight" in sd
    assert "model.layers.0.mlp.up_proj.weight" in sd
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in sd)
    assert preset_config("tiny")["vocab_size"] == 512
