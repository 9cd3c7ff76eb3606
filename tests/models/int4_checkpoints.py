"""Tiny 4-bit checkpoints for the tests, written here independently of batchgen's code: a plain
round-to-nearest quantizer and each format's packing written from its published description
(AutoGPTQ / GPTQModel, AutoAWQ's GEMM layout, compressed-tensors pack-quantized). Each writer
also saves the weights as the format defines them, dequantized, as an ordinary float32
checkpoint (`<dir>/reference`) that transformers loads as the reference.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

# Dimensions are multiples of 128 so every group size up to 128 divides them.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + AWQ_ORDER[i]


def dense_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random float32 llama state dict in HF names (std ~ 1 / sqrt(fan-in) for projections)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}  # fmt: skip
    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=g) * 0.5,
           "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "lm_head.weight": torch.randn(v, h, generator=g) * 0.1}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        out[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        for name, (n, k) in shapes.items():
            out[p + name + ".weight"] = torch.randn(n, k, generator=g) * 1.5 / k**0.5
    return out


def rtn(w: torch.Tensor, groups: torch.Tensor, num_groups: int, symmetric: bool, zero_min: int = 0):
    """Round-to-nearest 4-bit quantization of w [N, K] with input channel k in group groups[k].

    Returns q [N, K] in 0..15, zero [N, G] integers, scale [N, G] float16 (as checkpoints store
    it); the weight the format defines is (q - zero) * scale, with the stored scale.
    """
    n = w.shape[0]
    scale = torch.empty(n, num_groups, dtype=torch.float16)
    zero = torch.empty(n, num_groups, dtype=torch.int64)
    q = torch.empty(w.shape, dtype=torch.int64)
    for gi in range(num_groups):
        cols = (groups == gi).nonzero().flatten()
        block = w[:, cols].double()
        if symmetric:
            amax = block.abs().amax(dim=1).clamp(min=1e-8)
            s = (amax / 7.5).to(torch.float16)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            s = ((hi - lo).clamp(min=1e-8) / 15).to(torch.float16)
            z = torch.round(-lo / s.double()).long().clamp(zero_min, 15)
        scale[:, gi], zero[:, gi] = s, z
        q[:, cols] = torch.clamp(
            torch.round(block / s.double()[:, None]) + z[:, None], 0, 15
        ).long()
    return q, zero, scale


def dequantized(q, zero, scale, groups) -> torch.Tensor:
    """(q - zero[group]) * scale[group] in float32, [N, K]."""
    return ((q - zero[:, groups]).double() * scale.double()[:, groups]).float()


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """values [R, C] in 0..15 -> [R / 8, C] int32, word i holding rows 8i .. 8i + 7 (row 8i + j
    at bits 4j)."""
    r, c = values.shape
    words = torch.zeros(r // 8, c, dtype=torch.int64)
    for j in range(8):
        words |= values[j::8].long() << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_config(path: str, config: dict, tokenizer_dir: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


def base_config(tokenizer_dir: str) -> dict:
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        tok_config = json.load(f)
    keys = ("vocab_size", "bos_token_id", "eos_token_id")
    return {**TINY, **{k: tok_config[k] for k in keys}}


def save(path: str, config: dict, tensors: dict, reference: dict, tokenizer_dir: str) -> None:
    """The quantized checkpoint in `path` and its dequantized float32 twin in path/reference."""
    write_config(path, config, tokenizer_dir)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors")
    )
    ref = os.path.join(path, "reference")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    write_config(ref, plain, tokenizer_dir)
    save_file(
        {k: v.contiguous() for k, v in reference.items()}, os.path.join(ref, "model.safetensors")
    )


def _groups(k: int, group: int, desc_act: bool, seed: int) -> tuple[torch.Tensor, int]:
    """g_idx [K] and the group count: channel k in group k // group, or (act order) the
    channels taken in a random order, each run of `group` of them one group."""
    size = k if group == -1 else group
    if not desc_act:
        return torch.arange(k) // size, k // size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // size
    return g_idx, k // size


def write_gptq(path, tokenizer_dir, group=128, desc_act=False, sym=True, fmt="gptq", seed=0,
               quantize=PROJECTIONS, lm_head=False):  # fmt: skip
    """A GPTQ checkpoint: qweight [K/8, N] (8 rows of K per word), qzeros [G, N/8] (8 columns per
    word; stored zero - 1 in the v1 format `gptq`, the zero itself in `gptq_v2`), scales [G, N],
    g_idx [K]."""
    config = base_config(tokenizer_dir)
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": fmt, "lm_head": lm_head, "true_sequential": True,
        "damp_percent": 0.01,
    }  # fmt: skip
    state = dense_state(config, seed)
    tensors, reference = dict(state), dict(state)
    names = [f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in quantize]
    names += ["lm_head"] if lm_head else []
    for layer, name in enumerate(names):
        w = tensors.pop(name + ".weight")
        n, k = w.shape
        # One act order per input: q/k/v share one, gate/up another (as GPTQ's Hessian does).
        g_idx, count = _groups(k, group, desc_act, seed=hash((layer // 7, k)) % 1000)
        q, zero, scale = rtn(w, g_idx, count, sym, zero_min=1 if fmt == "gptq" else 0)
        reference[name + ".weight"] = dequantized(q, zero, scale, g_idx)
        tensors[name + ".qweight"] = pack_along_rows(q.t())  # [K/8, N]
        stored = zero - 1 if fmt == "gptq" else zero
        tensors[name + ".qzeros"] = _pack_cols(stored.t())  # [G, N/8]
        tensors[name + ".scales"] = scale.t().contiguous()  # [G, N]
        tensors[name + ".g_idx"] = g_idx.to(torch.int32)
    save(path, config, tensors, reference, tokenizer_dir)
    return path


def _pack_cols(values: torch.Tensor, order=None) -> torch.Tensor:
    """values [R, C] in 0..15 -> [R, C / 8] int32: word c holds columns 8c .. 8c + 7, column
    8c + order[i] at bits 4i (order: 0..7 unless given)."""
    order = order or list(range(8))
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= values[:, col::8].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_awq(path, tokenizer_dir, group=128, seed=0):
    """An AWQ (GEMM) checkpoint: qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's
    order, scales [G, N]; zero points always."""
    config = base_config(tokenizer_dir)
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None,
    }  # fmt: skip
    state = dense_state(config, seed)
    tensors, reference = dict(state), dict(state)
    for i in range(config["num_hidden_layers"]):
        for p in PROJECTIONS:
            name = f"model.layers.{i}.{p}"
            w = tensors.pop(name + ".weight")
            g_idx, count = _groups(w.shape[1], group, False, 0)
            q, zero, scale = rtn(w, g_idx, count, symmetric=False)
            reference[name + ".weight"] = dequantized(q, zero, scale, g_idx)
            tensors[name + ".qweight"] = _pack_cols(q.t(), AWQ_ORDER)  # [K, N/8]
            tensors[name + ".qzeros"] = _pack_cols(zero.t(), AWQ_ORDER)  # [G, N/8]
            tensors[name + ".scales"] = scale.t().contiguous()
    save(path, config, tensors, reference, tokenizer_dir)
    return path


def write_compressed(path, tokenizer_dir, group=128, sym=True, seed=0, zp_packed=True,
                     actorder=None):  # fmt: skip
    """A compressed-tensors pack-quantized checkpoint: weight_packed [N, K/8] (signed value + 8,
    element 8i + j at bits 4j of word i), weight_scale [N, G], weight_shape (N, K); asymmetric:
    weight_zero_point, signed, packed along N ([N/8, G] int32) or int8 [N, G]; group act
    order: weight_g_idx."""
    config = base_config(tokenizer_dir)
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "actorder": actorder,
               "group_size": None if group == -1 else group, "observer": "minmax"}  # fmt: skip
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
        "sparsity_config": {},
    }  # fmt: skip
    state = dense_state(config, seed)
    tensors, reference = dict(state), dict(state)
    for i in range(config["num_hidden_layers"]):
        for p in PROJECTIONS:
            name = f"model.layers.{i}.{p}"
            w = tensors.pop(name + ".weight")
            n, k = w.shape
            g_idx, count = _groups(k, group, actorder == "group", seed=i)
            q, zero, scale = rtn(w, g_idx, count, sym)
            reference[name + ".weight"] = dequantized(q, zero, scale, g_idx)
            signed = q - 8  # the library's int4 value (zero point 0 when symmetric), stored + 8
            tensors[name + ".weight_packed"] = pack_along_rows((signed + 8).t()).t().contiguous()
            tensors[name + ".weight_scale"] = scale  # [N, G]
            tensors[name + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                zp = zero - 8  # signed zero point
                tensors[name + ".weight_zero_point"] = (
                    pack_along_rows(zp + 8) if zp_packed else zp.to(torch.int8)
                )
            if actorder == "group":
                tensors[name + ".weight_g_idx"] = g_idx.to(torch.int32)
    save(path, config, tensors, reference, tokenizer_dir)
    return path
