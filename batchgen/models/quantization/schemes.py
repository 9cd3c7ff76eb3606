"""Read a checkpoint's `quantization_config` into which projection gets which FP8 scheme, refusing
(by name, saying what is supported) anything batchgen does not run.

Supported:
- compressed-tensors, format float-quantized: FP8 e4m3 (num_bits 8, type float, symmetric)
  weights per tensor, per channel or per block (block_structure); input activations absent
  (weight only), dynamic per token, static per tensor, or dynamic per group (with block
  weights, group_size = the block's width); `targets` Linear or `re:` patterns, `ignore` names
  or `re:` patterns; `kv_cache_scheme` FP8 per tensor (static k_scale / v_scale).
- fp8 (the Hugging Face / DeepSeek-V3 / Qwen3 `-FP8` format): e4m3 weights in
  weight_block_size blocks with weight_scale_inv and dynamic activations per token per group of
  the block's width; or, without weight_block_size, per-tensor weight_scale with static
  input_scale (activation_scheme static). modules_to_not_convert / ignored_layers are honoured,
  and lm_head is never converted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from batchgen.layers.fp8_linear import Fp8Scheme
from batchgen.models.errors import ModelLoadError

SUPPORTED = (
    "compressed-tensors float-quantized FP8 (weights per tensor / channel / block; activations "
    "none, dynamic per token, static per tensor, or dynamic per group with block weights), and "
    "quant_method fp8 (block-wise with weight_block_size and dynamic activations, or per-tensor "
    "with static activations)"
)


@dataclass
class CheckpointScheme:
    """Per Hugging Face module name, its FP8 scheme or None (left unquantized)."""

    method: str
    scale_name: str  # the weight-scale tensor's suffix: weight_scale or weight_scale_inv
    # (targets, runtime scheme, the checkpoint's weight strategy: tensor | channel | block)
    groups: list[tuple[list[str], Fp8Scheme, str]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    substring_ignore: bool = False  # fp8 format: an entry anywhere in the name ignores it
    kv_cache_scales: bool = False

    def scheme_of(self, module: str) -> Fp8Scheme | None:
        group = self._group_of(module)
        return group[1] if group else None

    def strategy_of(self, module: str) -> str | None:
        """How the checkpoint stores module's weight scale: tensor, channel or block."""
        group = self._group_of(module)
        return group[2] if group else None

    def _group_of(self, module: str):
        if module == "lm_head" and self.method == "fp8":
            return None
        for entry in self.ignore:
            if _matches(entry, module, self.substring_ignore):
                return None
        for group in self.groups:
            if any(t == "Linear" or _matches(t, module, False) for t in group[0]):
                return group
        return None


def _matches(entry: str, module: str, substring: bool) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    if substring:
        return entry in module
    return module == entry or module.endswith("." + entry)


def _refuse(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{source}: quantization_config {what} is not supported; supported: {SUPPORTED}"
    )


def parse(qc: dict[str, Any], source: str) -> CheckpointScheme:
    """The CheckpointScheme of a quantization_config; raises ModelLoadError naming what is not
    supported."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fp8":
        return _fp8(qc, source)
    raise _refuse(source, f"quant_method {method!r}")


def _fp8_args(args: dict | None, where: str, source: str) -> None:
    if not isinstance(args, dict):
        raise _refuse(source, f"{where} {args!r}")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if args.get(key, want) != want:
            raise _refuse(source, f"{where}.{key}={args.get(key)!r} (FP8 e4m3 needs {want!r})")


def _compressed_tensors(qc: dict, source: str) -> CheckpointScheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if groups and fmt != "float-quantized":
        raise _refuse(source, f"format {fmt!r}")
    out = CheckpointScheme(
        "compressed-tensors", "weight_scale", ignore=list(qc.get("ignore") or [])
    )
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if group.get("output_activations") is not None:
            raise _refuse(source, f"{where}.output_activations")
        targets = group.get("targets") or []
        for t in targets:
            if not (t == "Linear" or (isinstance(t, str) and t.startswith("re:"))):
                raise _refuse(source, f"{where}.targets entry {t!r} (Linear or re: patterns)")
        strategy = (group.get("weights") or {}).get("strategy", "tensor")
        out.groups.append((targets, _ct_scheme(group, where, source), strategy))
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        _fp8_args(kv, "kv_cache_scheme", source)
        if kv.get("strategy", "tensor") != "tensor" or kv.get("dynamic", False):
            raise _refuse(source, "kv_cache_scheme other than static per tensor")
        out.kv_cache_scales = True
    return out


def _ct_scheme(group: dict, where: str, source: str) -> Fp8Scheme:
    weights = group.get("weights")
    _fp8_args(weights, f"{where}.weights", source)
    strategy = weights.get("strategy", "tensor")
    if weights.get("dynamic", False):
        raise _refuse(source, f"{where}.weights.dynamic=true")
    block = None
    if strategy == "block":
        block = tuple(weights.get("block_structure") or ())
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise _refuse(source, f"{where}.weights.block_structure={block!r}")
    elif strategy not in ("tensor", "channel"):
        raise _refuse(source, f"{where}.weights.strategy={strategy!r}")
    acts = group.get("input_activations")
    if acts is None:
        return Fp8Scheme("block" if block else "channel", None, block)
    _fp8_args(acts, f"{where}.input_activations", source)
    a_strategy, dynamic = acts.get("strategy", "tensor"), acts.get("dynamic", False)
    if a_strategy == "token" and dynamic and not block:
        return Fp8Scheme("channel", "token")
    if a_strategy == "tensor" and not dynamic and not block:
        return Fp8Scheme("channel", "tensor")
    if a_strategy == "group" and dynamic and block and acts.get("group_size") == block[1]:
        return Fp8Scheme("block", "group", block)
    if a_strategy == "tensor" and dynamic:
        raise _refuse(
            source,
            f"{where}.input_activations dynamic per tensor (a scale over the whole batch: "
            "outputs would depend on which requests share a step)",
        )
    raise _refuse(
        source,
        f"{where}.input_activations strategy={a_strategy!r} dynamic={dynamic!r} with "
        f"{strategy} weights",
    )


def _fp8(qc: dict, source: str) -> CheckpointScheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(source, f"fmt {qc.get('fmt')!r}")
    act = qc.get("activation_scheme", "dynamic")
    block = qc.get("weight_block_size")
    ignore = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
    if block is not None:
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise _refuse(source, f"weight_block_size {block!r}")
        if act != "dynamic":
            raise _refuse(source, f"activation_scheme {act!r} with weight_block_size")
        scheme = Fp8Scheme("block", "group", tuple(block))
        groups = [(["Linear"], scheme, "block")]
        return CheckpointScheme("fp8", "weight_scale_inv", groups, ignore, True)
    if act != "static":
        raise _refuse(
            source,
            f"activation_scheme {act!r} without weight_block_size (a dynamic per-tensor "
            "activation scale spans the whole batch: outputs would depend on which requests "
            "share a step)",
        )
    groups = [(["Linear"], Fp8Scheme("channel", "tensor"), "tensor")]
    return CheckpointScheme("fp8", "weight_scale", groups, ignore, True)
