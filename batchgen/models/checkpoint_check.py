"""config.json against the weight files' headers: every tensor's name, shape and dtype, no weights.

Run before the model is built (load_model) and by `batchgen run` / `batchgen validate` before
anything loads, so a config that does not belong to its weights (a vocabulary of 10^12, twice
the layers, another hidden size) is refused in milliseconds with the file, tensor and config
keys named, instead of after allocating the model it describes. Pickle checkpoints have no
header to read: only their config's bounds are checked here; the loader checks the shapes.
A checkpoint with a 4-bit quantization_config (batchgen/models/int4) has its format's tensors
checked in place of the 16-bit weights of the modules it quantizes; one with another (FP8)
quantization_config may hold e4m3 weights and their scale tensors (batchgen.models.quantization
says which it runs).
"""

from __future__ import annotations

import os

from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.int4.checkpoint import Int4Checkpoint, read_int4_checkpoint
from batchgen.models.int4.scheme import is_int4_config
from batchgen.models.int4.tp_slices import check_split
from batchgen.models.moe_config import expert_tensor_shapes
from batchgen.models.quantization.kv_scales import kv_scale_slot
from batchgen.models.safetensors_header import TensorInfo, read_header
from batchgen.models.weight_files import find_weight_files

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what the loader copies into the model
FP8_DTYPE = "F8_E4M3"  # FP8 checkpoints' weights (batchgen.models.quantization checks which)
# Tensors an FP8 checkpoint adds beside its weights (their shapes: the quantization plan's).
QUANTIZATION_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
_SHOWN = 6  # names listed in a message before "..."


def expected_shapes(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """{HF tensor name: (shape, the config keys that size it)} of a llama-family checkpoint
    (mixture-of-experts layers: their router and per-expert tensors).
    A tied lm_head is left out (the loader ignores one a checkpoint carries)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, inter, v, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    qk = "num_attention_heads, head_dim, hidden_size"
    kvk = "num_key_value_heads, head_dim, hidden_size"
    out = {
        "model.embed_tokens.weight": ((v, h), "vocab_size, hidden_size"),
        "model.norm.weight": ((h,), "hidden_size"),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), "vocab_size, hidden_size")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": ((h,), "hidden_size"),
            "post_attention_layernorm.weight": ((h,), "hidden_size"),
            "self_attn.q_proj.weight": ((q, h), qk),
            "self_attn.k_proj.weight": ((kv, h), kvk),
            "self_attn.v_proj.weight": ((kv, h), kvk),
            "self_attn.o_proj.weight": ((h, q), qk),
        }
        if c.moe is not None and c.moe.sparse_layers[i]:  # router and experts instead
            out.update(expert_tensor_shapes(c.architecture, i, h, c.moe))
        else:
            layer["mlp.gate_proj.weight"] = ((inter, h), "intermediate_size, hidden_size")
            layer["mlp.up_proj.weight"] = ((inter, h), "intermediate_size, hidden_size")
            layer["mlp.down_proj.weight"] = ((h, inter), "hidden_size, intermediate_size")
        if c.qkv_bias:
            layer["self_attn.q_proj.bias"] = ((q,), "num_attention_heads, head_dim")
            layer["self_attn.k_proj.bias"] = ((kv,), "num_key_value_heads, head_dim")
            layer["self_attn.v_proj.bias"] = ((kv,), "num_key_value_heads, head_dim")
        if c.o_bias:
            layer["self_attn.o_proj.bias"] = ((h,), "hidden_size")
        if c.qk_norm:
            layer["self_attn.q_norm.weight"] = ((d,), "head_dim")
            layer["self_attn.k_norm.weight"] = ((d,), "head_dim")
        if c.mlp_bias:
            layer["mlp.gate_proj.bias"] = ((inter,), "intermediate_size")
            layer["mlp.up_proj.bias"] = ((inter,), "intermediate_size")
            layer["mlp.down_proj.bias"] = ((h,), "hidden_size")
        out.update({p + k: val for k, val in layer.items()})
    return out


def checkpoint_headers(path: str, allow_pickle: bool = False) -> dict[str, TensorInfo] | None:
    """Every tensor of the checkpoint's safetensors files by name; None when a weight file is
    a pickle (no header). Raises ModelLoadError for missing, damaged or duplicated tensors."""
    files = find_weight_files(path, allow_pickle)
    if not all(f.endswith(".safetensors") for f in files):
        return None
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in tensors:
                raise ModelLoadError(f"{f}: tensor {name!r} is also in {tensors[name].file}")
            tensors[name] = info
    return tensors


def check_checkpoint(
    path: str, config: ModelConfig, allow_pickle: bool = False, tensor_parallel_size: int = 1
) -> Int4Checkpoint | None:
    """Raise ModelLoadError unless the weights in `path` are exactly what `config` describes:
    every tensor present once, with the expected shape and a float dtype, and no other; a 4-bit
    checkpoint must also split over tensor_parallel_size ranks (int4/tp_slices.check_split).

    Returns:
        The checkpoint's 4-bit modules and scheme when config.json has a (supported)
        quantization_config, else None.
    """
    source = os.path.join(path, "config.json")
    qc = config.quantization_config
    int4 = qc is not None and is_int4_config(qc)
    tensors = checkpoint_headers(path, allow_pickle)
    if tensors is None:
        if int4:
            raise ModelLoadError(f"{path}: 4-bit checkpoints load from safetensors files only")
        return None
    expected = expected_shapes(config)
    quant = None
    if int4:
        if config.moe is not None:
            raise ModelLoadError(
                f"{source}: quantized mixture-of-experts checkpoints are not supported yet "
                f"(quantization_config with {config.architecture})"
            )
        projections = {n: s for n, (s, _) in expected.items() if len(s) == 2 and "embed" not in n}
        try:
            quant = read_int4_checkpoint(qc, source, projections, tensors)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        for module in quant.modules:
            del expected[module + ".weight"]
    quantized = qc is not None and not int4  # FP8: e4m3 weights beside their scales
    for name, (shape, keys) in expected.items():
        info = tensors.get(name)
        if info is None:
            continue
        if info.shape != shape:
            values = ", ".join(f"{k}={_config_value(config, k)}" for k in keys.split(", "))
            raise ModelLoadError(
                f"{info.file}: tensor {name!r} has shape {info.shape}, but {source} "
                f"({values}) makes it {shape}; the config and weights do not belong together"
            )
        if info.dtype not in FLOAT_DTYPES and not (quantized and info.dtype == FP8_DTYPE):
            raise ModelLoadError(
                f"{info.file}: tensor {name!r} has dtype {info.dtype}; batchgen loads "
                "float16, bfloat16 or float32 weights, and FP8 ones of checkpoints whose "
                "config.json has a quantization_config"
            )
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path}: the weights are missing {len(missing)} tensor(s) that {source} describes "
            f"(num_hidden_layers={config.num_hidden_layers}; the weights have "
            f"{_layers_in(tensors)} layer(s)): {_names(missing)}"
        )
    tied_copy = "lm_head.weight" if config.tie_word_embeddings else None
    known = set(quant.tensors) if quant is not None else set()
    unused = [
        n
        for n in tensors
        if n not in expected
        and n not in known
        and n != tied_copy
        and not n.endswith("rotary_emb.inv_freq")
        and kv_scale_slot(n) is None  # K/V-cache scales (an FP8 KV cache's)
        and not (quantized and n.endswith(QUANTIZATION_SUFFIXES))
    ]
    if unused:
        raise ModelLoadError(
            f"{path}: the weights hold {len(unused)} tensor(s) that {source} does not "
            f"describe (a {config.architecture} of {config.num_hidden_layers} layer(s)): "
            f"{_names(unused)}"
        )
    if quant is not None:
        check_split(quant, config, tensor_parallel_size)
    return quant


def _config_value(config: ModelConfig, key: str) -> int:
    """The value config.json gave `key` (the experts' keys live in config.moe)."""
    moe = {"num_experts": "num_experts", "moe_intermediate_size": "intermediate_size"}
    if key in moe and config.moe is not None:
        return getattr(config.moe, moe[key])
    return getattr(config, key)


def _layers_in(tensors: dict[str, TensorInfo]) -> int:
    found = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
    return len(found)


def _names(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (" ..." if len(names) > _SHOWN else "")
