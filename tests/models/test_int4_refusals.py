"""4-bit checkpoints batchgen does not run, or that do not hold together, are refused before any
weight loads, naming the file, key or tensor and what is supported."""

from __future__ import annotations

import json
import os

import pytest
import torch
from int4_checkpoints import write_awq, write_compressed, write_gptq
from safetensors.torch import load_file, save_file

from batchgen.models.checkpoint_check import check_checkpoint
from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.loader import load_model
from batchgen.models.quantization import load_plan


@pytest.fixture(scope="module")
def tok_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    for key, value in changes.items():
        if value is None:
            qc.pop(key, None)
        else:
            qc[key] = value
    with open(config_path, "w") as f:
        json.dump(config, f)


def edit_tensors(path: str, change) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


def refused(path: str, match: str) -> None:
    config = ModelConfig.from_dir(path)
    with pytest.raises(ModelLoadError, match=match):  # what `batchgen validate` and `run` check
        load_plan(config, None, f"{path}/config.json")  # the config alone
        check_checkpoint(path, config)  # then the headers
    with pytest.raises(ModelLoadError, match=match):
        load_model(path, "float32", "cpu")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"bits": 8}, r"bits=8 \(batchgen runs 4-bit GPTQ\)"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format='marlin' \(gptq or gptq_v2\)"),
        ({"group_size": 48}, r"group_size=48 \(-1 or a positive multiple of 32\)"),
        ({"dynamic": {"-:.*down": {}}}, "dynamic"),
        ({"pack_dtype": "int16"}, "pack_dtype='int16'"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ],
)
def test_gptq_config_refused(tmp_path, tok_dir, changes, match):
    path = write_gptq(str(tmp_path), tok_dir, 128)
    edit_config(path, **changes)
    refused(path, match)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"version": "gemv"}, r"version='gemv' \(gemm\)"),
        ({"zero_point": False}, r"zero_point=False \(true\)"),
        ({"bits": 3}, "bits=3"),
    ],
)
def test_awq_config_refused(tmp_path, tok_dir, changes, match):
    path = write_awq(str(tmp_path), tok_dir, 128)
    edit_config(path, **changes)
    refused(path, match)


def _ct_group(path: str, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    group = config["quantization_config"]["config_groups"]["group_0"]
    for key, value in changes.items():
        target, _, leaf = key.rpartition(".")
        (group[target] if target else group)[leaf] = value
    with open(config_path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
        ({"weights.num_bits": 8}, r"num_bits=8 \(4\)"),
        ({"weights.strategy": "tensor"}, r"strategy='tensor' \(group or channel\)"),
        ({"weights.type": "float"}, r"type='float' \('int'\)"),
        ({"weights.dynamic": True}, "dynamic=True"),
    ],
)
def test_compressed_tensors_config_refused(tmp_path, tok_dir, changes, match):
    path = write_compressed(str(tmp_path), tok_dir, 128)
    _ct_group(path, **changes)
    refused(path, match)


def test_other_compressed_tensors_formats_refused_by_name(tmp_path, tok_dir):
    path = write_compressed(str(tmp_path), tok_dir, 128)
    edit_config(path, format="int-quantized")
    refused(path, "quant_method 'compressed-tensors', format 'int-quantized' is not supported")
    # float-quantized is FP8 (batchgen.models.quantization): 4-bit int weights are refused there.
    edit_config(path, format="float-quantized")
    refused(path, r"weights.num_bits=4 \(FP8 e4m3 needs 8\)")


def test_half_quantized_fused_projection_refused(tmp_path, tok_dir):
    # q/k/v run as one fused projection: k alone in 16 bits cannot join the 4-bit q and v.
    path = write_gptq(str(tmp_path), tok_dir, 128, quantize=("self_attn.q_proj",
                      "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj"))  # fmt: skip
    with pytest.raises(ModelLoadError, match="q_proj, .*v_proj are 4-bit but .*k_proj"):
        load_model(path, "float32", "cpu")


def test_missing_and_misshapen_tensors_refused(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path / "a"), tok_dir, 128)
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"))
    refused(path, r"lack model\.layers\.1\.mlp\.up_proj\.qzeros")
    path = write_gptq(str(tmp_path / "b"), tok_dir, 128)
    name = "model.layers.0.self_attn.o_proj.scales"
    edit_tensors(path, lambda t: t.__setitem__(name, t[name][:1].contiguous()))
    refused(path, r"o_proj\.scales' is F16 \(1, 256\); a gptq module of 256 outputs")


def test_quantized_embedding_refused(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path), tok_dir, 128)

    def add(t):
        t["model.embed_tokens.qweight"] = torch.zeros(32, 256, dtype=torch.int32)

    edit_tensors(path, add)
    refused(path, "embed_tokens is stored in 4 bits, but it is not a projection")


def test_both_weight_and_qweight_refused(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path), tok_dir, 128)
    name = "model.layers.0.mlp.down_proj"
    edit_tensors(path, lambda t: t.__setitem__(name + ".weight", torch.zeros(256, 512)))
    refused(path, "down_proj has both a 16-bit weight and gptq tensors")


def test_bad_g_idx_refused(tmp_path, tok_dir):
    # g_idx must give each group exactly group_size channels (as GPTQ writes it).
    path = write_gptq(str(tmp_path), tok_dir, 64, desc_act=True)
    name = "model.layers.0.self_attn.k_proj.g_idx"

    def skew(t):
        g = t[name].clone()
        g[:8] = 0
        t[name] = g

    edit_tensors(path, skew)
    with pytest.raises(ModelLoadError, match="g_idx does not give every group exactly"):
        load_model(path, "float32", "cpu")


def test_config_says_gptq_but_weights_are_16_bit(tmp_path, tok_dir, tiny_model_dir):
    import shutil

    path = str(tmp_path / "m")
    shutil.copytree(tiny_model_dir("llama"), path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    refused(path, r"no tensor of the weights ends in \.qweight")


def test_online_fp8_of_a_4_bit_checkpoint_refused(tmp_path, tok_dir):
    path = write_gptq(str(tmp_path), tok_dir, 128)
    with pytest.raises(ModelLoadError, match=r"quantization='fp8' with a 4-bit gptq checkpoint"):
        load_model(path, "float32", "cpu", quantization="fp8")
