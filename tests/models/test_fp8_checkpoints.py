"""Published FP8 checkpoint layouts load and run as their schemes say: weight-only schemes equal
transformers (with the compressed-tensors package) within 1e-4 in fp32; activation schemes equal
transformers on the dequantized weights with each projection's input fake-quantized (per token,
per static tensor scale, or per 1 x 128 group), written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import (
    E4M3,
    checkpoint_weights,
    fake_quant,
    max_logprob_gap,
    write_compressed_tensors,
    write_fp8_blockwise,
    write_fp8_static,
)

from batchgen import LLM
from batchgen.layers.fp8_linear import Fp8Linear

transformers = pytest.importorskip("transformers")

TEXT = [
    "The committee measured the annual budget after a long debate.",
    "Our team reviewed the survey results before the deadline, with some surprise.",
]
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def wide_dir(tiny_model_dir, tmp_path_factory):
    """A random Llama whose projections are multiples of 128 (block scales need whole blocks),
    built with transformers' own classes, with the tiny models' tokenizer."""
    src = Path(tiny_model_dir("llama"))
    dst = tmp_path_factory.mktemp("wide")
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    hf.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return str(dst)


def _hf(path: str):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference(src: str, ckpt: str, activations: str | None, input_scales=None):
    """transformers' model of src with ckpt's dequantized weights; each quantized projection's
    input fake-quantized as `activations` says (None: weight only)."""
    hf = _hf(src)
    weights = checkpoint_weights(ckpt)
    state = hf.state_dict()
    state.update({k: v for k, v in weights.items() if k in state})
    hf.load_state_dict(state)
    quantized = {n[: -len(".weight")] for n, t in _raw(ckpt).items() if t.dtype == E4M3}
    for name, module in hf.named_modules():
        if name not in quantized or activations is None:
            continue

        def hook(mod, args, name=name):
            x = args[0]
            if activations == "tensor":
                s = input_scales[name]
                return ((x / s).clamp(-448, 448).to(E4M3).float() * s,)
            return (fake_quant(x, 128 if activations == "group" else None),)

        module.register_forward_pre_hook(hook)
    return hf


def _raw(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def _input_scales(src: str) -> dict[str, float]:
    """Static activation scales as a calibration would give them: max |input| / 448 of every
    projection over the test text (q/k/v and gate/up share an input, so a scale)."""
    hf, amax = _hf(src), {}
    tok = transformers.AutoTokenizer.from_pretrained(src)
    handles = []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":

            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())

            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for text in TEXT:
            hf(torch.tensor([tok(text)["input_ids"]]))
    return {name: a / 448 for name, a in amax.items()}


def _max_logprob_gap(llm: LLM, hf) -> float:
    return max_logprob_gap(llm, hf, [llm.tokenizer.encode(text) for text in TEXT])


def _fp8_layers(llm: LLM) -> dict[str, Fp8Linear]:
    model = llm.engine.runner.model
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("weights", ["tensor", "channel"])
def test_compressed_tensors_weight_only_equals_transformers(tiny_model_dir, tmp_path, weights):
    pytest.importorskip("compressed_tensors")
    ckpt = write_compressed_tensors(tiny_model_dir("llama"), tmp_path / "ct", weights, None)
    llm = LLM(ckpt, **ENGINE)
    layers = _fp8_layers(llm)
    assert len(layers) == 2 * 4 and all(m.scheme.activation is None for m in layers.values())
    assert _max_logprob_gap(llm, _hf(ckpt)) <= 1e-4  # transformers decompresses it itself


def test_compressed_tensors_block_weight_only_equals_dequantized(wide_dir, tmp_path):
    ckpt = write_compressed_tensors(wide_dir, tmp_path / "ct", "block", None)
    llm = LLM(ckpt, **ENGINE)
    assert {m.scheme.weight for m in _fp8_layers(llm).values()} == {"block"}
    assert _max_logprob_gap(llm, _reference(wide_dir, ckpt, None)) <= 1e-4


@pytest.mark.parametrize(
    "weights, activations", [("channel", "token"), ("tensor", "token"), ("tensor", "tensor")]
)
def test_compressed_tensors_activation_schemes_equal_fake_quant(
    tiny_model_dir, tmp_path, weights, activations
):
    src = tiny_model_dir("llama")
    scales = _input_scales(src) if activations == "tensor" else None
    kv = {0: (0.02, 0.03), 1: (0.05, 0.01)} if activations == "tensor" else None
    ckpt = write_compressed_tensors(src, tmp_path / "ct", weights, activations, scales, kv)
    llm = LLM(ckpt, **ENGINE)
    assert {m.scheme.activation for m in _fp8_layers(llm).values()} == {activations}
    hf = _reference(src, ckpt, activations, scales)
    gap = _max_logprob_gap(llm, hf)
    assert gap <= 1e-4
    assert _max_logprob_gap(llm, _reference(src, ckpt, None)) > 10 * max(gap, 1e-6)  # it matters
    if kv:
        stored = [s for pair in llm.engine.kv_scales() for s in pair]  # float32 values
        assert stored == pytest.approx([0.02, 0.03, 0.05, 0.01], rel=1e-6)


def test_compressed_tensors_block_and_group_equal_fake_quant(wide_dir, tmp_path):
    ckpt = write_compressed_tensors(wide_dir, tmp_path / "ct", "block", "group")
    llm = LLM(ckpt, **ENGINE)
    assert {m.scheme for m in _fp8_layers(llm).values()} == {
        type(next(iter(_fp8_layers(llm).values())).scheme)("block", "group", (128, 128))
    }
    assert _max_logprob_gap(llm, _reference(wide_dir, ckpt, "group")) <= 1e-4


def test_compressed_tensors_ignore_list_leaves_modules_16_bit(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    ckpt = write_compressed_tensors(
        src, tmp_path / "ct", "channel", "token", ignore_prefixes=("model.layers.1.mlp",)
    )
    llm = LLM(ckpt, **ENGINE)
    names = set(_fp8_layers(llm))
    assert "model.layers.1.mlp.gate_up_proj" not in names and "lm_head" not in names
    assert "model.layers.1.self_attn.qkv_proj" in names and len(names) == 6
    assert _max_logprob_gap(llm, _reference(src, ckpt, "token")) <= 1e-4


def test_fp8_blockwise_with_modules_to_not_convert(wide_dir, tmp_path):
    ckpt = write_fp8_blockwise(wide_dir, tmp_path / "fp8", ("model.layers.0.mlp",))
    llm = LLM(ckpt, **ENGINE)
    names = set(_fp8_layers(llm))
    assert "model.layers.0.mlp.gate_up_proj" not in names and len(names) == 6
    assert _max_logprob_gap(llm, _reference(wide_dir, ckpt, "group")) <= 1e-4


def test_fp8_per_tensor_static(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    scales = _input_scales(src)
    ckpt = write_fp8_static(src, tmp_path / "fp8", scales)
    llm = LLM(ckpt, **ENGINE)
    assert _max_logprob_gap(llm, _reference(src, ckpt, "tensor", scales)) <= 1e-4


def test_online_fp8_equals_fake_quant_of_per_channel_weights(tiny_model_dir):
    src = tiny_model_dir("llama")
    llm = LLM(src, quantization="fp8", **ENGINE)
    layers = _fp8_layers(llm)
    assert len(layers) == 8 and "lm_head" not in layers
    hf = _hf(src)
    state = hf.state_dict()
    for name in state:  # per-output-row scales max |w| / 448, as written out here
        if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                       "up_proj", "down_proj"):  # fmt: skip
            w = state[name].float()
            s = w.abs().amax(dim=1, keepdim=True) / 448
            state[name] = (w / s).to(E4M3).float() * s
    hf.load_state_dict(state)
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(lambda m, a: (fake_quant(a[0], None),))
    assert _max_logprob_gap(llm, hf) <= 1e-4


def test_fp8_mlps_under_16_bit_attention_are_not_folded(tiny_model_dir, tmp_path):
    # qkv stays 16-bit but gate_up is FP8: the RMSNorm weights cannot be folded into the MLP's
    # weights, so the engine (fold_norms on by default) folds neither.
    src = tiny_model_dir("llama")
    ckpt = write_compressed_tensors(
        src, tmp_path / "ct", "channel", "token", ignore_prefixes=("model.layers.0.self_attn",)
    )
    llm = LLM(ckpt, **ENGINE)
    assert "model.layers.0.mlp.gate_up_proj" in _fp8_layers(llm)
    assert not llm.engine.runner.model.norms_folded
    assert _max_logprob_gap(llm, _reference(src, ckpt, "token")) <= 1e-4
