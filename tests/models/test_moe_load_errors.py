"""A broken mixture-of-experts checkpoint or config fails at load, naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.loader import build_model, load_model, load_weights
from batchgen.models.weight_files import find_weight_files
from batchgen.models.weights import iter_tensors


def _copy_with(src: str, dst: str, edit_tensors=None, edit_config=None) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, "model.safetensors")
    if edit_tensors is not None:
        tensors = load_file(weights)
        edit_tensors(tensors)
        save_file(tensors, weights, metadata={"format": "pt"})
    if edit_config is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return dst


def test_missing_expert_tensor_is_named(tiny_model_dir, tmp_path):
    def drop(t):
        del t["model.layers.0.mlp.experts.5.up_proj.weight"]

    path = _copy_with(tiny_model_dir("qwen3_moe"), tmp_path / "m", drop)
    # The headers are checked against config.json before the model is built.
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*experts\.5\.up_proj\.weight"):
        load_model(str(path))
    # The loader's own count: expert 5's up rows are shard 2 * 5 + 1 of gate_up_proj.
    config = ModelConfig.from_dir(str(path))
    model = build_model(config, torch.float32, torch.device("cpu"))
    tensors = iter_tensors(find_weight_files(str(path)))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*experts\.gate_up_proj\[11\]"):
        load_weights(model, tensors)


def test_expert_beyond_num_experts_is_named(tiny_model_dir, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.4.w1.weight"  # 4 experts: 0..3

    def add(t):
        t[name] = t["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()

    path = _copy_with(tiny_model_dir("mixtral"), tmp_path / "m", add)
    with pytest.raises(ModelLoadError, match=r"does not\s+describe.*experts\.4\.w1\.weight"):
        load_model(str(path))
    config = ModelConfig.from_dir(str(path))
    model = build_model(config, torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"does not use: .*experts\.4\.w1\.weight"):
        load_weights(model, iter_tensors(find_weight_files(str(path))))


def test_wrong_expert_shape_names_the_tensor(tiny_model_dir, tmp_path):
    def shrink(t):
        name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        t[name] = t[name][:, :-1].contiguous()

    path = _copy_with(tiny_model_dir("mixtral"), tmp_path / "m", shrink)
    with pytest.raises(
        ModelLoadError, match=r"experts\.2\.w2\.weight.*has shape.*intermediate_size=176"
    ):
        load_model(str(path))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("moe_intermediate_size"), "missing required key 'moe_intermediate_size'"),
        (lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok=9"),
        (lambda c: c.update(mlp_only_layers="1"), "mlp_only_layers must be a list"),
        (lambda c: c.update(use_sliding_window=True, sliding_window=64), "sliding_window=64"),
    ],
    ids=["no-moe-intermediate", "top-k-past-experts", "bad-mlp-only-layers", "sliding-window"],
)
def test_bad_qwen3_moe_config_is_named(tiny_model_dir, edit, message):
    with open(os.path.join(tiny_model_dir("qwen3_moe"), "config.json")) as f:
        raw = json.load(f)
    edit(raw)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(raw, source="m/config.json")


def test_mixtral_sliding_window_is_refused(tiny_model_dir):
    with open(os.path.join(tiny_model_dir("mixtral"), "config.json")) as f:
        raw = json.load(f)
    raw["sliding_window"] = 128
    with pytest.raises(ModelLoadError, match="sliding_window=128"):
        ModelConfig.from_dict(raw)


def test_wrong_router_shape_names_the_experts_key(tiny_model_dir, tmp_path):
    def widen(t):
        name = "model.layers.0.mlp.gate.weight"
        t[name] = torch.cat([t[name], t[name][:1]])  # 9 rows for 8 experts

    path = _copy_with(tiny_model_dir("qwen3_moe"), tmp_path / "m", widen)
    with pytest.raises(ModelLoadError, match=r"mlp\.gate\.weight.*\(9, 64\).*num_experts=8"):
        load_model(str(path))
