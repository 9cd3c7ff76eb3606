"""ModelConfig: the architecture hyper-parameters read from a Hugging Face config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from batchgen.models.errors import ModelLoadError
from batchgen.models.registry import supported_architectures


@dataclass(frozen=True)
class ModelConfig:
    """Normalized decoder hyper-parameters; arch-specific switches are explicit booleans."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v carry a bias; Llama: attention_bias (q/k/v/o)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default=())
    # config.json's quantization_config as written (batchgen/models/quantization reads it).
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        """Read `path/config.json` (and `generation_config.json` for EOS ids)."""
        config_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ModelLoadError(f"model path {path!r} is not a directory")
        if not os.path.isfile(config_path):
            raise ModelLoadError(
                f"{config_path}: missing config.json — a model directory needs config.json, "
                "model.safetensors (or shards + index) and tokenizer.json"
            )
        try:
            with open(config_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from e
        generation = _read_optional_json(os.path.join(path, "generation_config.json"))
        return cls.from_dict(raw, source=config_path, generation=generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], source: str = "config.json", generation: dict | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in supported_architectures():
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; supported: "
                + ", ".join(supported_architectures())
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelLoadError(f"{source}: missing required key {key!r} for {arch}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope(raw, source)
        if arch == "MistralForCausalLM" or (
            arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window")
        ):
            window = raw.get("sliding_window")
            max_pos = int(raw.get("max_position_embeddings", 0))
            if window is not None and (arch != "MistralForCausalLM" or int(window) < max_pos):
                raise ModelLoadError(
                    f"{source}: sliding_window={window} attention is not supported yet; "
                    "use a checkpoint whose config has sliding_window null"
                )
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _eos_ids(raw, generation)
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            quantization_config=_quantization_config(raw, source),
        )


def _quantization_config(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    value = raw.get("quantization_config")
    if value is not None and not isinstance(value, dict):
        raise ModelLoadError(f"{source}: quantization_config must be a mapping, got {value!r}")
    return value


def _read_optional_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Both dialects: published `rope_theta` + `rope_scaling`, transformers 5 `rope_parameters`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else {}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ModelLoadError(
            f"{source}: rope scaling type {rope_type!r} is not supported (supported: default, "
            "llama3, linear)"
        )
    return theta, {"rope_type": rope_type, **scaling}


def _eos_ids(raw: dict[str, Any], generation: dict | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation or {}, raw):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)
