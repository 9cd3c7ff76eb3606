"""config.json is checked for sane sizes and against the safetensors headers before allocation."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.models import loader
from batchgen.models.checkpoint_check import check_checkpoint, expected_shapes
from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.presets import TINY_PRESETS
from batchgen.models.safetensors_header import read_header
from batchgen.models.tokenizer import Tokenizer


def copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def no_allocation(*args, **kwargs):
    raise AssertionError("the model was allocated before the config was checked")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("vocab_size", 10**12, r"vocab_size=1000000000000 must be an integer from 1 to"),
        ("num_attention_heads", 0, r"num_attention_heads=0 must be an integer from 1"),
        ("vocab_size", "lots", r"vocab_size='lots' must be an integer"),
        ("hidden_size", True, r"hidden_size=True must be an integer"),
        ("num_hidden_layers", -2, r"num_hidden_layers=-2 must be an integer"),
        ("intermediate_size", [176], r"intermediate_size=\[176\] must be an integer"),
        ("num_key_value_heads", 3, r"num_attention_heads=4 is not a multiple of num_key_value"),
        ("head_dim", 15, r"head_dim=15 must be even"),
        ("rope_theta", "fast", r"unusable value"),
        ("rms_norm_eps", -1.0, r"rms_norm_eps=-1.0 must be in \(0, 1\)"),
        ("max_position_embeddings", 2**40, r"max_position_embeddings=1099511627776 must be"),
    ],
)
def test_absurd_config_values_are_refused_naming_file_and_key(
    tiny_model_dir, tmp_path, monkeypatch, key, value, message
):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    edit_config(path, **{key: value})
    monkeypatch.setattr(loader, "build_model", no_allocation)
    with pytest.raises(ModelLoadError, match=message) as e:
        loader.load_model(path)
    assert str(e.value).startswith(os.path.join(path, "config.json"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 64}, r"missing 558 tensor\(s\).*num_hidden_layers=64.*2 layer"),
        ({"hidden_size": 4096}, r"'model.embed_tokens.weight' has shape \(\d+, 64\).*hidden_size"),
        ({"vocab_size": 1 << 20}, r"embed_tokens.weight' has shape .*vocab_size=1048576"),
        ({"num_hidden_layers": 1}, r"hold 9 tensor\(s\) that .* does not describe"),
        ({"intermediate_size": 352}, r"gate_proj.weight' has shape \(176, 64\).*(352, 64)"),
    ],
)
def test_config_that_does_not_match_its_weights_is_refused_before_allocation(
    tiny_model_dir, tmp_path, monkeypatch, changes, message
):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    edit_config(path, **changes)
    monkeypatch.setattr(loader, "build_model", no_allocation)
    with pytest.raises(ModelLoadError, match=message):
        loader.load_model(path)


def test_quantized_or_integer_weights_are_refused(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, weights)
    config = ModelConfig.from_dir(path)
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.up_proj.weight' has dtype I8"):
        check_checkpoint(path, config)


def test_fp8_weights_need_a_quantization_config(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors["model.layers.0.self_attn.o_proj.weight_scale"] = torch.ones(1)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"o_proj.weight' has dtype F8_E4M3; .*FP8 ones of"):
        check_checkpoint(path, ModelConfig.from_dir(path))


@pytest.mark.parametrize("layout", ["channel-static-kv", "block", "fp8-blockwise"])
def test_fp8_checkpoints_pass_with_their_scale_tensors(tiny_model_dir, tmp_path, layout):
    from fp8_checkpoints import write_compressed_tensors, write_fp8_blockwise

    src = tiny_model_dir("llama")
    if layout == "fp8-blockwise":
        path = write_fp8_blockwise(src, tmp_path / "m")
    elif layout == "block":
        path = write_compressed_tensors(src, tmp_path / "m", "block", "group")
    else:
        modules = [n[: -len(".weight")] for n in load_file(f"{src}/model.safetensors")]
        scales = dict.fromkeys(modules, 0.01)
        kv = {0: (0.02, 0.03), 1: (0.04, 0.05)}
        path = write_compressed_tensors(src, tmp_path / "m", "channel", "tensor", scales, kv)
    header = read_header(os.path.join(path, "model.safetensors"))
    kinds = {info.dtype for info in header.values()}
    assert "F8_E4M3" in kinds
    check_checkpoint(path, ModelConfig.from_dir(path))  # raises on a tensor it does not expect
    # A stray tensor is still refused in a quantized checkpoint.
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match="extra_proj"):
        check_checkpoint(path, ModelConfig.from_dir(path))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[:5], "shorter than its 8-byte header length"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header length 1000000000"),
        (lambda b: b[:8] + b"[" + b[9:], "header is not JSON"),
        (lambda b: b[: len(b) // 2], "do not match its shape and file"),
    ],
)
def test_damaged_headers_are_named(tiny_model_dir, tmp_path, damage, why):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "rb") as f:
        data = f.read()
    with open(weights, "wb") as f:
        f.write(damage(data))
    with pytest.raises(ModelLoadError, match=f"model.safetensors: not a readable.*{why}"):
        read_header(weights)


def test_header_reader_agrees_with_the_safetensors_library(tiny_model_dir):
    from safetensors import safe_open

    weights = os.path.join(tiny_model_dir("qwen3"), "model.safetensors")
    ours = read_header(weights)
    with safe_open(weights, "pt") as f:
        theirs = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert {n: i.shape for n, i in ours.items()} == theirs
    assert {i.dtype for i in ours.values()} == {"F32"}


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {}),
    ],
)
def test_expected_shapes_are_transformers_state_dict(arch, extra):
    transformers = pytest.importorskip("transformers")
    raw = {**TINY_PRESETS[arch], "vocab_size": 320, **extra}
    hf_config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    ours = {n: shape for n, (shape, _) in expected_shapes(ModelConfig.from_dict(raw)).items()}
    assert ours == theirs


def test_list_shaped_tokenizer_config_is_a_model_error(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump([{"bos_token": "<s>"}], f)
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json: must be a JSON object"):
        Tokenizer.from_dir(path)
