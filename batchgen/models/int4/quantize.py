"""Quantize a 16-bit checkpoint's decoder projections to 4 bits by round-to-nearest and write a GPTQ
checkpoint (checkpoint_format gptq, the v1 layout AutoGPTQ writes and most engines read).

    python -m batchgen.models.int4.quantize SRC DST [--group-size 128] [--asym]

Per output channel and group of `group_size` input channels: symmetric (default) scale = max |w|
/ 7.5, zero point 8; asymmetric scale = (max - min) / 15 over the group's range widened to
include 0, zero point round(-min / scale) kept in 1 .. 15 (v1 stores zero - 1). Values
q = clamp(round(w / scale) + zero, 0, 15); the weight is (q - zero) * scale with the float16
scale. The embedding, norms and the LM head stay as they are; other files are copied.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

from batchgen.models.config import read_json_object
from batchgen.models.int4 import nibbles
from batchgen.models.weight_files import find_weight_files
from batchgen.models.weights import iter_tensors

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SKIP = ("model.safetensors", "model.safetensors.index.json", "config.json")


def quantize_weight(
    w: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int in 0 .. 15, zero [N, G] int, scale [N, G] float16)."""
    n, k = w.shape
    size = k if group_size == -1 else group_size
    if k % size:
        raise ValueError(f"{k} input channels are not a multiple of group_size {size}")
    blocks = w.float().reshape(n, k // size, size)  # [N, G, size]
    if symmetric:
        scale = (blocks.abs().amax(-1).clamp(min=1e-8) / 7.5).half()
        zero = torch.full(scale.shape, 8, dtype=torch.int64)
    else:
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
        scale = ((hi - lo).clamp(min=1e-8) / 15).half()
        zero = torch.round(-lo / scale.float()).long().clamp(1, 15)
    q = torch.round(blocks / scale.float()[..., None]) + zero[..., None]
    return q.clamp(0, 15).long().reshape(n, k), zero, scale


def gptq_tensors(w: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """One projection's GPTQ v1 tensors: qweight [K/8, N], qzeros [G, N/8] (zero - 1), scales
    [G, N], g_idx [K]."""
    q, zero, scale = quantize_weight(w, group_size, symmetric)
    k = w.shape[1]
    size = k if group_size == -1 else group_size
    return {
        "qweight": nibbles.pack(q.t(), dim=0),
        "qzeros": nibbles.pack((zero - 1).t(), dim=1),
        "scales": scale.t().contiguous(),
        "g_idx": (torch.arange(k) // size).to(torch.int32),
    }


def quantize_checkpoint(src: str, dst: str, group_size: int = 128, symmetric: bool = True) -> None:
    """Write the GPTQ checkpoint of `src` (a 16-bit HF model directory) into `dst`."""
    config = read_json_object(os.path.join(src, "config.json"))
    if config.get("quantization_config"):
        raise ValueError(f"{src}: already quantized ({config['quantization_config']})")
    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for _, name, tensor in iter_tensors(find_weight_files(src)):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            for suffix, t in gptq_tensors(tensor, group_size, symmetric).items():
                out[f"{module}.{suffix}"] = t.contiguous()
        else:
            out[name] = tensor.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
        "sym": symmetric, "checkpoint_format": "gptq", "lm_head": False,
        "quantizer": "batchgen round-to-nearest",
    }  # fmt: skip
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if entry not in _SKIP and os.path.isfile(path) and not entry.endswith(".safetensors"):
            shutil.copy(path, os.path.join(dst, entry))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Round-to-nearest 4-bit GPTQ checkpoint of SRC.")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--group-size", type=int, default=128, help="-1: one group per channel")
    ap.add_argument("--asym", action="store_true", help="zero points per group (default: 8)")
    args = ap.parse_args(argv)
    quantize_checkpoint(args.src, args.dst, args.group_size, not args.asym)
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
