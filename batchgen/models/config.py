"""ModelConfig: the architecture hyper-parameters read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from batchgen.models.errors import ModelLoadError
from batchgen.models.moe_config import MoeConfig, moe_config
from batchgen.models.registry import supported_architectures
from batchgen.short_repr import short_repr


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
    moe: MoeConfig | None = None  # routed experts (Qwen3-MoE, Mixtral); None for dense models
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
        raw = read_json_object(config_path)
        generation = _read_optional_json(os.path.join(path, "generation_config.json"))
        return cls.from_dict(raw, source=config_path, generation=generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], source: str = "config.json", generation: dict | None = None
    ) -> ModelConfig:
        """Normalize a config mapping; every value is checked for type and sane bounds (SIZE_
        BOUNDS) before anything is sized from it. Raises ModelLoadError naming source and key."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: must be a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        if not isinstance(arch, str) or arch not in supported_architectures():
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; supported: "
                + ", ".join(supported_architectures())
            )
        try:
            return cls._from_checked(raw, source, generation, arch)
        except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
            if isinstance(e, ModelLoadError):
                raise
            # A value of a shape no check above foresaw: still the file's fault, named.
            raise ModelLoadError(f"{source}: unusable value ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_checked(
        cls, raw: dict[str, Any], source: str, generation: dict | None, arch: str
    ) -> ModelConfig:
        def size(key: str, default: int | None = None) -> int:
            return _bounded_int(raw, key, source, arch, default)

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads) if raw.get("num_key_value_heads") else heads
        if raw.get("head_dim"):
            head_dim = size("head_dim")
        elif hidden % heads:
            raise ModelLoadError(
                f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads="
                f"{heads}, and no head_dim is given"
            )
        else:
            head_dim = hidden // heads
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim={head_dim} must be even (rotary embedding)")
        max_pos = size("max_position_embeddings", 2048)
        rope_theta, rope_scaling = _rope(raw, source)
        windowed = ("MistralForCausalLM", "MixtralForCausalLM")
        if arch in windowed or (
            arch in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM") and raw.get("use_sliding_window")
        ):
            window = raw.get("sliding_window")
            if window is not None and (arch not in windowed or int(window) < max_pos):
                raise ModelLoadError(
                    f"{source}: sliding_window={window} attention is not supported yet; "
                    "use a checkpoint whose config has sliding_window null"
                )
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _eos_ids(raw, generation)
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not 0 < eps < 1:
            raise ModelLoadError(f"{source}: rms_norm_eps={eps!r} must be in (0, 1)")
        return cls(
            architecture=arch,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=attention_bias if arch in _O_BIAS else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            moe=moe_config(raw, arch, size("num_hidden_layers"), source, size),
            quantization_config=_quantization_config(raw, source),
        )


def _quantization_config(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    value = raw.get("quantization_config")
    if value is not None and not isinstance(value, dict):
        raise ModelLoadError(f"{source}: quantization_config must be a mapping, got {value!r}")
    return value


# Architectures whose attention_bias also puts a bias on o_proj.
_O_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


# The largest value each size may take: far past every published model (vocabularies reach
# 262k, hidden sizes 16k, contexts 10M), near enough that no config sizes an allocation no
# host could make. A value past its bound is refused before anything is allocated from it.
SIZE_BOUNDS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 25,
    # Mixtures of experts (moe_config.py); Qwen3-235B-A22B has 128 experts, DeepSeek-V3 256.
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "num_experts_per_tok": 1 << 10,
    "moe_intermediate_size": 1 << 20,
    "decoder_sparse_step": 1024,
}


def _bounded_int(raw: dict[str, Any], key: str, source: str, arch: str, default=None) -> int:
    """raw[key] as an int in [1, SIZE_BOUNDS[key]]; ModelLoadError naming source and key."""
    if key not in raw or raw[key] is None:
        if default is None:
            raise ModelLoadError(f"{source}: missing required key {key!r} for {arch}")
        return default
    value = raw[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    top = SIZE_BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise ModelLoadError(
            f"{source}: {key}={short_repr(value)} must be an integer from 1 to {top:,}; the "
            "file is damaged or not this model's config"
        )
    return value


def read_json_object(path: str) -> dict[str, Any]:
    """A model file that must hold one JSON object; ModelLoadError naming it otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path}: must be a JSON object, got a {type(obj).__name__}")
    return obj


def _read_optional_json(path: str) -> dict | None:
    return read_json_object(path) if os.path.isfile(path) else None


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Both dialects: published `rope_theta` + `rope_scaling`, transformers 5 `rope_parameters`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else {}
    if not 0 < theta < math.inf:
        raise ModelLoadError(f"{source}: rope_theta={theta!r} must be a finite number > 0")
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
