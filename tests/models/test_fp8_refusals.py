"""Quantized checkpoints batchgen does not run are refused naming what was found and what is
supported, before any weight loads (`batchgen validate` included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fp8_checkpoints import write_compressed_tensors

from batchgen import LLM
from batchgen.config import ConfigError, EngineConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.quantization.schemes import SUPPORTED, parse

FP8 = {"num_bits": 8, "type": "float", "symmetric": True}


def _ct(weights=None, acts=None, **top):
    group = {"targets": ["Linear"], "weights": {**FP8, "strategy": "channel", **(weights or {})},
             "input_activations": acts, "output_activations": None}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], **top}  # fmt: skip


@pytest.mark.parametrize(
    "config, found",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        (_ct(format="pack-quantized"), "format 'pack-quantized'"),
        (_ct({"num_bits": 4, "type": "int"}), "weights.num_bits=4"),
        (_ct({"symmetric": False}), "weights.symmetric=False"),
        (_ct({"strategy": "group", "group_size": 128}), "weights.strategy='group'"),
        (_ct(acts={**FP8, "strategy": "tensor", "dynamic": True}), "dynamic per tensor"),
        (
            _ct(acts={**FP8, "strategy": "token", "dynamic": False}),
            "strategy='token' dynamic=False",
        ),
        (_ct(acts={**FP8, "num_bits": 4, "strategy": "token", "dynamic": True}), "num_bits=4"),
        (_ct(kv_cache_scheme={**FP8, "strategy": "head"}), "kv_cache_scheme other than"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            "activation_scheme 'dynamic' without",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "activation_scheme 'static' with weight_block_size",
        ),  # fmt: skip
    ],
)
def test_unsupported_configs_are_refused_by_name(config, found):
    with pytest.raises(ModelLoadError) as e:
        parse(config, "m/config.json")
    assert found in str(e.value) and "m/config.json: quantization_config" in str(e.value)
    assert SUPPORTED in str(e.value)


def test_supported_configs_parse():
    scheme = parse(_ct(acts={**FP8, "strategy": "token", "dynamic": True}), "c")
    assert scheme.scheme_of("model.layers.0.self_attn.q_proj").activation == "token"
    assert scheme.scheme_of("lm_head") is None
    block = parse({"quant_method": "fp8", "weight_block_size": [128, 128],
                   "modules_to_not_convert": ["mlp.gate"]}, "c")  # fmt: skip
    assert block.scale_name == "weight_scale_inv"
    assert block.scheme_of("model.layers.3.mlp.gate") is None  # substring match, as HF's
    assert block.scheme_of("model.layers.3.mlp.down_proj").block == (128, 128)
    assert block.scheme_of("lm_head") is None


def _model_with(tmp_path: Path, src: str, quantization_config: dict) -> str:
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_engine_refuses_before_loading_weights(tiny_model_dir, tmp_path):
    path = _model_with(tmp_path, tiny_model_dir("llama"), {"quant_method": "bitsandbytes"})
    with pytest.raises(
        ModelLoadError, match=r"m/config.json: quantization_config quant_method 'bitsandbytes'"
    ):
        LLM(path, dtype="float32", num_kv_blocks=16)
    # A 4-bit config (batchgen.models.int4) over 16-bit weights: the weights lack its tensors.
    path = _model_with(tmp_path / "g", tiny_model_dir("llama"), {"quant_method": "gptq", "bits": 4})
    with pytest.raises(
        ModelLoadError, match=r"gptq, but no tensor of the weights ends in .qweight"
    ):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_validate_refuses_the_model(tiny_model_dir, tmp_path, monkeypatch):
    from batchgen.job import JobError, load_job
    from batchgen.pipeline.engine_factory import model_limits

    path = _model_with(tmp_path, tiny_model_dir("llama"), {"quant_method": "bitsandbytes"})
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "x"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{path: {path}}}\ninput: {{path: {tmp_path}/in.jsonl}}\n"
        "prompt: {template: '{text}'}\noutput: {path: " + str(tmp_path / "out") + "}\n"
    )
    with pytest.raises(JobError, match="quant_method 'bitsandbytes' is not supported"):
        model_limits(load_job(str(job)))


def test_fused_projections_need_one_scheme(tiny_model_dir, tmp_path):
    config = _ct(acts={**FP8, "strategy": "token", "dynamic": True})
    config["ignore"] = ["lm_head", "model.layers.0.self_attn.q_proj"]
    path = _model_with(tmp_path, tiny_model_dir("llama"), config)
    with pytest.raises(ModelLoadError, match="q_proj, .*k_proj, .*v_proj are fused"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_block_scales_need_whole_blocks_to_fuse(tiny_model_dir, tmp_path):
    # The tiny llama's q_proj has 64 rows: a 128-row block would straddle q and k.
    path = write_compressed_tensors(tiny_model_dir("llama"), tmp_path / "ct", "block", None)
    with pytest.raises(ModelLoadError, match="q_proj has 64 output rows, not a multiple of"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_fp8_tensor_of_an_ignored_module_is_refused(tiny_model_dir, tmp_path):
    path = write_compressed_tensors(tiny_model_dir("llama"), tmp_path / "ct", "channel", None)
    config = json.loads(Path(path, "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:model.layers.1.*")
    Path(path, "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.layers.1.* is FP8, but quantization_config"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_quantization_option_values():
    with pytest.raises(ConfigError, match="quantization='int4': expected null or fp8"):
        EngineConfig(model="m", quantization="int4")
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"


def _no_build(*args, **kwargs):
    raise AssertionError("a model was built before the refusal")


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_4_bit_checkpoints_of_moe_models_are_refused_before_building(
    tiny_moe_dir, tmp_path, monkeypatch, variant
):
    # FP8 MoE checkpoints load (test_fp8_moe.py); 4-bit ones are refused by name.
    monkeypatch.setattr("batchgen.models.loader.build_model", _no_build)
    path = _model_with(tmp_path, tiny_moe_dir(variant), GPTQ)
    with pytest.raises(ModelLoadError, match="m/config.json: a 4-bit checkpoint of a mixture"):
        LLM(path, dtype="float32", num_kv_blocks=16)


def test_validate_refuses_static_expert_scales_of_a_moe_checkpoint(tiny_moe_dir, tmp_path):
    from batchgen.job import JobError, load_job
    from batchgen.pipeline.engine_factory import model_limits

    static = {"quant_method": "fp8", "activation_scheme": "static"}
    path = _model_with(tmp_path, tiny_moe_dir("qwen3_moe"), static)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "text": "x"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{path: {path}}}\n"
        f"input: {{path: {tmp_path}/in.jsonl}}\n"
        "prompt: {template: '{text}'}\noutput: {path: " + str(tmp_path / "out") + "}\n"
    )
    with pytest.raises(JobError, match="static .per-tensor. input scales on the experts"):
        model_limits(load_job(str(job)))
