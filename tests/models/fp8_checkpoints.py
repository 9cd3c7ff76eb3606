"""Write FP8 checkpoints of a model directory in the published layouts, for the FP8 loading tests,
and compare what batchgen scores on them with a transformers reference (max_logprob_gap).

Written here from the formats' documentation, independently of batchgen's own quantization code:
- compressed-tensors `float-quantized` (RedHatAI / neuralmagic FP8 releases): each quantized
  Linear's `weight` in float8_e4m3fn and `weight_scale` float32 ([1] per tensor, [N, 1] per
  channel, [N / bn, K / bk] per block), `input_scale` [1] for static activations, and
  `self_attn.k_scale` / `v_scale` with a kv_cache_scheme; config.json's quantization_config
  names the scheme (config_groups, ignore, format, kv_cache_scheme).
- `quant_method: fp8` (Qwen3 `-FP8`, DeepSeek-V3): `weight` e4m3 in weight_block_size blocks
  with `weight_scale_inv` [N / 128, K / 128]; or per tensor with `weight_scale` and a static
  `input_scale` (activation_scheme static).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def quantize_weight(w: torch.Tensor, strategy: str, block=(128, 128)):
    """(e4m3 weight, scale as the checkpoint stores it); dequantized = float(q) * scale."""
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        return _to_e4m3(w, scale), scale
    if strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
        return _to_e4m3(w, scale), scale
    n, k = w.shape
    bn, bk = block
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=E4M3)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = tile.abs().max() / 448
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = _to_e4m3(tile, scale[i, j])
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, strategy: str, block=(128, 128)):
    if strategy != "block":
        return q.float() * scale
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def fake_quant(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Dynamic FP8 of x's rows (the last dim; or of each 1 x group piece of a row): rounded to
    e4m3 at scale max |x| / 448 and scaled back, in fp32."""
    x = x.float()
    out = []
    for chunk in x.split(group or x.shape[-1], dim=-1):
        s = chunk.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
        out.append((chunk / s).clamp(-448, 448).to(E4M3).float() * s)
    return torch.cat(out, dim=-1)


def _copy(src: str, dst: Path) -> dict[str, torch.Tensor]:
    shutil.copytree(src, dst)
    return load_file(dst / "model.safetensors")


def _quantized(name: str, skip: tuple[str, ...]) -> bool:
    module = name.rsplit(".", 1)[0]
    return (
        name.endswith(".weight")
        and module.rsplit(".", 1)[-1] in PROJECTIONS
        and not any(module.startswith(s) for s in skip)
    )


def _finish(dst: Path, tensors: dict, quantization_config: dict) -> str:
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


def write_compressed_tensors(
    src: str,
    dst: Path,
    weights: str,
    activations: str | None,
    input_scales: dict[str, float] | None = None,
    kv_scales: dict[int, tuple[float, float]] | None = None,
    ignore_prefixes: tuple[str, ...] = (),
) -> str:
    """A compressed-tensors FP8 checkpoint of `src`. weights: tensor | channel | block;
    activations: None | token (dynamic) | tensor (static, input_scales per module) | group
    (dynamic, 128 wide). ignore_prefixes: modules left in 16 bits (besides lm_head)."""
    tensors = _copy(src, dst)
    for name in [n for n in tensors if _quantized(n, ignore_prefixes)]:
        q, scale = quantize_weight(tensors[name], weights)
        module = name[: -len(".weight")]
        tensors[name] = q
        tensors[module + ".weight_scale"] = scale.float().contiguous()
        if activations == "tensor":
            tensors[module + ".input_scale"] = torch.tensor([input_scales[module]])
    for layer, (k, v) in (kv_scales or {}).items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    w_args = {**args, "strategy": weights, "dynamic": False, "block_structure": None}
    if weights == "block":
        w_args["block_structure"] = [128, 128]
    a_args = None
    if activations is not None:
        a_args = {**args, "strategy": activations, "dynamic": activations != "tensor"}
        if activations == "group":
            a_args["group_size"] = 128
    kv = None
    if kv_scales:
        kv = {**args, "strategy": "tensor", "dynamic": False}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": w_args,
                "input_activations": a_args,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *[f"re:{p}.*" for p in ignore_prefixes]],
        "kv_cache_scheme": kv,
    }
    return _finish(dst, tensors, config)


def write_fp8_blockwise(src: str, dst: Path, modules_to_not_convert: tuple[str, ...] = ()) -> str:
    """A `quant_method: fp8` checkpoint with 128 x 128 weight blocks (weight_scale_inv)."""
    tensors = _copy(src, dst)
    for name in [n for n in tensors if _quantized(n, modules_to_not_convert)]:
        q, scale = quantize_weight(tensors[name], "block")
        tensors[name] = q
        tensors[name[: -len(".weight")] + ".weight_scale_inv"] = scale
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return _finish(dst, tensors, config)


def write_fp8_static(src: str, dst: Path, input_scales: dict[str, float]) -> str:
    """A `quant_method: fp8` per-tensor checkpoint with static activation scales (AutoFP8)."""
    tensors = _copy(src, dst)
    for name in [n for n in tensors if _quantized(n, ())]:
        q, scale = quantize_weight(tensors[name], "tensor")
        module = name[: -len(".weight")]
        tensors[name] = q
        tensors[module + ".weight_scale"] = scale
        tensors[module + ".input_scale"] = torch.tensor([input_scales[module]])
    return _finish(dst, tensors, {"quant_method": "fp8", "activation_scheme": "static"})


def checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    """Every projection's dequantized fp32 weight of an FP8 checkpoint written here, by name."""
    tensors = load_file(f"{path}/model.safetensors")
    config = json.loads(Path(path, "config.json").read_text())["quantization_config"]
    if config["quant_method"] == "fp8":
        strategy = "block" if config.get("weight_block_size") else "tensor"
    else:
        strategy = config["config_groups"]["group_0"]["weights"]["strategy"]
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dtype == E4M3:
            module = name[: -len(".weight")]
            scale = tensors.get(module + ".weight_scale", tensors.get(module + ".weight_scale_inv"))
            out[name] = dequantize(t, scale.float(), strategy)
        elif name.endswith(".weight"):
            out[name] = t.float()
    return out


def max_logprob_gap(llm, hf, prompts: list[list[int]]) -> float:
    """The largest |log-prob| difference, over every token after the third of each prompt,
    between batchgen's `llm` (scoring the rest as a candidate) and the transformers model `hf`."""
    gap = 0.0
    for ids in prompts:
        (res,) = llm.score([ids[:3]], [[ids[3:]]], return_token_logprobs=True, use_tqdm=False)[0]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        ref = [logprobs[2 + i, t].item() for i, t in enumerate(ids[3:])]
        gap = max(gap, max(abs(a - b) for a, b in zip(res.token_logprobs, ref)))
    return gap
