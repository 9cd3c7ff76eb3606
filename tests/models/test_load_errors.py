"""Bad model directories fail with errors that name the file/tensor and what to do."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.models.errors import ModelLoadError
from batchgen.models.loader import load_model


def copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"missing config\.json"):
        load_model(str(tmp_path))


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a directory"):
        load_model(str(tmp_path / "nope"))


def test_unknown_architecture_lists_supported(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    config = json.load(open(cfg_path))
    config["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(config, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "'GPTNeoXForCausalLM' is not supported" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated"):
        load_model(path)


def test_wrong_tensor_shape_names_tensor_and_shapes(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "'model.layers.1.mlp.up_proj.weight'" in msg
    assert "(100, 64)" in msg and "(176, 64)" in msg


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(
        ModelLoadError, match=r"missing 1 tensor.*layers\.0\.self_attn\.k_proj\.weight"
    ):
        load_model(path)


def test_pickle_checkpoint_refused_without_opt_in(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    torch.save(load_file(weights), os.path.join(path, "pytorch_model.bin"))
    os.remove(weights)
    with pytest.raises(ModelLoadError, match=r"pickle checkpoints found \(pytorch_model\.bin\)"):
        load_model(path)
    model, _ = load_model(path, allow_pickle=True)  # opt-in: torch.load(weights_only=True)
    ref, _ = load_model(tiny_model_dir("llama"))
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_sharded_checkpoint_loads(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("qwen2"), tmp_path / "m")
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, file))
        weight_map.update({k: file for k in keys})
    os.remove(weights)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    model, _ = load_model(path)
    ref, _ = load_model(tiny_model_dir("qwen2"))
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_mistral_sliding_window_refused(tiny_model_dir, tmp_path):
    path = copy_model(tiny_model_dir("mistral"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    config = json.load(open(cfg_path))
    config["sliding_window"] = 128
    json.dump(config, open(cfg_path, "w"))
    with pytest.raises(ModelLoadError, match="sliding_window=128 attention is not supported"):
        load_model(path)


def test_dtype_auto_is_float32_on_cpu(tiny_model_dir):
    model, _ = load_model(tiny_model_dir("llama"), "auto", "cpu")
    assert next(model.parameters()).dtype == torch.float32
    model, _ = load_model(tiny_model_dir("llama"), "bfloat16", "cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_hf_export_round_trips_through_the_loader(tiny_model_dir):
    from batchgen.models.hf_export import to_hf_state_dict
    from batchgen.models.loader import build_model, load_weights

    model, config = load_model(tiny_model_dir("qwen2"))
    exported = to_hf_state_dict(model)
    original = load_file(os.path.join(tiny_model_dir("qwen2"), "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    fresh = build_model(config, torch.float32, torch.device("cpu"))
    load_weights(fresh, (("export", k, v) for k, v in exported.items()))
    for (name, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def test_hf_export_of_folded_model_divides_the_norms_back_out(tiny_model_dir):
    from batchgen.models.hf_export import to_hf_state_dict

    model, _ = load_model(tiny_model_dir("llama"))
    assert model.fold_norms_()
    exported = to_hf_state_dict(model)
    original = load_file(os.path.join(tiny_model_dir("llama"), "model.safetensors"))
    assert exported.keys() == original.keys()
    for k in original:  # fp32 multiply then divide: within a rounding or two
        torch.testing.assert_close(exported[k], original[k], atol=0, rtol=3e-7)


def test_hf_export_moves_each_tensor_before_unfolding(tiny_model_dir):
    # The bench's peer exports an 8B model to the CPU beside a full KV cache: every tensor
    # must move before the fp32 unfold (a meta target shows no arithmetic ran where they were).
    from batchgen.models.hf_export import to_hf_state_dict

    model, _ = load_model(tiny_model_dir("llama"))
    assert model.fold_norms_()
    here = to_hf_state_dict(model)
    moved = to_hf_state_dict(model, device="meta")
    assert moved.keys() == here.keys()
    assert all(t.device.type == "meta" and t.shape == here[k].shape for k, t in moved.items())
    on_cpu = to_hf_state_dict(model, device="cpu")
    assert all(torch.equal(on_cpu[k], here[k]) for k in here)
