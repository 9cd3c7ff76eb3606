"""Online FP8 (`quantization: fp8`) of mixture-of-experts models on CPU: every expert's gate, up
and down rows become e4m3 with per-row scales, their inputs quantized per token, and the
log-probs equal transformers' model with that quantization written out here (weights rounded
per row to e4m3 at max |w| / 448, each projection's input per token, the experts' own loop
spelled out below); the router stays 16-bit."""

from __future__ import annotations

import os
import types

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE
from fp8_checkpoints import fake_quant, max_logprob_gap

from batchgen import LLM
from batchgen.layers.fp8_linear import Fp8Linear
from batchgen.layers.moe import Fp8FusedExperts, SparseMoeBlock

transformers = pytest.importorskip("transformers")

ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8)
PROMPTS = [[0, 17, 42, 99, 5, 301, 12, 7, 250, 3, 8, 64], [0, 250, 3, 3, 77, 140, 2, 9, 31]]
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def experts_forward(group: int | None = None):
    """transformers' expert loop with every projection's input quantized per token (or per
    `group` columns; the weights already rounded where the caller rounds them):
    out[t] = sum_k w_tk * down(silu(gate(x_t)) * up(x_t)). A method for an experts module."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            x = fake_quant(hidden[token], group)
            gate, up = (x @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = fake_quant(torch.nn.functional.silu(gate) * up, group) @ self.down_proj[e].t()
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out

    return forward


def reference(path: str):
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if hasattr(module, "gate_up_proj") and isinstance(module.gate_up_proj, torch.Tensor):
                module.gate_up_proj.copy_(fake_quant(module.gate_up_proj))
                module.down_proj.copy_(fake_quant(module.down_proj))
                module.forward = types.MethodType(experts_forward(), module)
            elif isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in DENSE:
                module.weight.copy_(fake_quant(module.weight))
                module.register_forward_pre_hook(lambda m, a: (fake_quant(a[0]),))
    return hf


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_online_fp8_moe_equals_fake_quant_reference(tiny_moe_dir, variant):
    path = tiny_moe_dir(variant)
    llm = LLM(path, quantization="fp8", **ENGINE)
    model = llm.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts, Fp8FusedExperts) for b in blocks)
    assert all(b.experts.gate_up_proj.dtype == FP8_DTYPE for b in blocks)
    assert not any(isinstance(b.gate, Fp8Linear) for b in blocks)  # the router stays 16-bit
    hf = reference(path)
    assert max_logprob_gap(llm, hf, PROMPTS) <= 1e-4
    # FP8 moved the log-probs: the unquantized model is further away than the tolerance.
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert max_logprob_gap(llm, plain, PROMPTS) > 1e-3


def test_online_fp8_moe_greedy_generation_runs_with_the_kv_cache_in_fp8(tiny_moe_dir):
    from batchgen import SamplingParams

    llm = LLM(tiny_moe_dir("mixtral"), quantization="fp8", kv_cache_dtype="fp8", **ENGINE)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [12, 12]
    assert all(o.error is None for o in out)


def test_bench_runs_a_moe_preset_with_fp8_experts(tmp_path):
    import json

    from click.testing import CliRunner

    from batchgen.bench.cli import bench

    out = tmp_path / "b.json"
    args = ["--model-preset", "tiny-moe", "--device", "cpu", "--quantization", "fp8",
            "--num-prompts", "4", "--max-output-tokens", "6", "--warmup", "0"]  # fmt: skip
    result = CliRunner().invoke(bench, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "experts/layer/step" in result.output
    report = json.loads(out.read_text())
    assert report["result"]["output_tokens"] == 24
    # The roofline reads the experts at one byte a weight (the run's dtype is fp32).
    experts = report["model"]["experts"]
    assert experts["expert_bytes"] == experts["expert_params"] > 0


# ---- published FP8 checkpoints of MoE models ---------------------------------------------------


def dequantized_copy(ckpt: str, dst) -> str:
    """A 16-bit twin of FP8 checkpoint `ckpt` (written by fp8_checkpoints.py): every FP8
    weight replaced by float(q) * scale, scales and quantization_config dropped."""
    import json
    import shutil

    from fp8_checkpoints import checkpoint_weights
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, dst)
    tensors = load_file(f"{ckpt}/model.safetensors")
    weights = checkpoint_weights(ckpt)
    out = {}
    for name, t in tensors.items():
        if name.rpartition(".")[2] in ("weight_scale", "weight_scale_inv", "input_scale"):
            continue
        out[name] = weights[name] if t.dtype == FP8_DTYPE else t
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    config = json.loads(open(f"{dst}/config.json").read())
    config.pop("quantization_config")
    open(f"{dst}/config.json", "w").write(json.dumps(config))
    return str(dst)


def checkpoint_reference(twin: str, group: int | None):
    """transformers' model of the 16-bit twin with every projection's input (the experts'
    included, the routers' not) quantized per token or per group."""
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()

    for name, module in hf.named_modules():
        if hasattr(module, "gate_up_proj") and isinstance(module.gate_up_proj, torch.Tensor):
            module.forward = types.MethodType(experts_forward(group), module)
        elif isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in DENSE:
            module.register_forward_pre_hook(lambda m, a: (fake_quant(a[0], group),))
    return hf


@pytest.mark.parametrize(
    "fmt, weights, activations, group",
    [
        ("compressed-tensors", "channel", "token", None),
        ("compressed-tensors", "tensor", "token", None),
        ("compressed-tensors", "block", "group", 128),
        ("fp8", "block", "group", 128),
    ],
)
def test_fp8_moe_checkpoints_equal_fake_quant_of_their_weights(
    tiny_moe_dir, tmp_path, fmt, weights, activations, group
):
    from fp8_checkpoints import write_compressed_tensors, write_fp8_blockwise

    src = tiny_moe_dir("qwen3_moe_blocks" if weights == "block" else "qwen3_moe")
    if fmt == "fp8":
        ckpt = write_fp8_blockwise(src, tmp_path / "ckpt")
    else:
        ckpt = write_compressed_tensors(src, tmp_path / "ckpt", weights, activations)
    llm = LLM(ckpt, **ENGINE)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts, Fp8FusedExperts) for b in blocks)
    assert all(b.experts.scheme.activation == activations for b in blocks)
    assert not any(isinstance(b.gate, Fp8Linear) for b in blocks)  # routers stay 16-bit
    hf = checkpoint_reference(dequantized_copy(ckpt, tmp_path / "twin"), group)
    assert max_logprob_gap(llm, hf, PROMPTS) <= 1e-4


def test_static_input_scales_on_experts_are_refused_before_building(
    tiny_moe_dir, tmp_path, monkeypatch
):
    from fp8_checkpoints import write_fp8_static
    from safetensors.torch import load_file

    from batchgen.models.errors import ModelLoadError

    src = tiny_moe_dir("qwen3_moe")
    names = [n for n in load_file(f"{src}/model.safetensors") if n.endswith("_proj.weight")]
    ckpt = write_fp8_static(src, tmp_path / "ckpt", {n[: -len(".weight")]: 0.02 for n in names})

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr("batchgen.models.loader.build_model", no_build)
    with pytest.raises(ModelLoadError, match="static .per-tensor. input scales on the experts"):
        LLM(ckpt, **ENGINE)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
@pytest.mark.parametrize("source", ["online", "block-checkpoint"])
def test_loaded_fp8_experts_through_the_triton_kernel(tiny_moe_dir, tmp_path, source):
    # The experts and scales the loader builds (block scales of gate and up apart, per-row
    # online scales) through the GPU kernel (interpreted on CPU) equal the reference.
    from batchgen.kernels.fused_moe_fp8 import fused_moe_fp8, fused_moe_fp8_ref
    from batchgen.kernels.fused_moe_tiles import GemmTile, MoeTiles
    from fp8_checkpoints import write_compressed_tensors

    if source == "online":
        llm = LLM(tiny_moe_dir("qwen3_moe"), quantization="fp8", **ENGINE)
    else:
        src = tiny_moe_dir("qwen3_moe_blocks")
        llm = LLM(write_compressed_tensors(src, tmp_path / "c", "block", "group"), **ENGINE)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock))
    e = block.experts
    hidden = torch.randn(9, e.gate_up_proj.shape[2], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, ids = block.route(hidden)
    args = (hidden, e.gate_up_proj, e.gate_up_scale, e.down_proj, e.down_scale, weights, ids)
    tiles = MoeTiles(16, GemmTile(16, 16, 1, 4, 1), GemmTile(16, 16, 1, 4, 1))
    got = fused_moe_fp8(*args, e.scheme, tiles=tiles)
    want = fused_moe_fp8_ref(*args, e.scheme)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
