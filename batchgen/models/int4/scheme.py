"""Read a checkpoint's `quantization_config` into an Int4Scheme: which 4-bit format its tensors are
in and how to read them, refusing (by key and value, saying what is supported) anything else.

Supported:
- quant_method gptq: bits 4, group_size -1 / 32 / 64 / 128 / any multiple of 32, desc_act true or
  false (g_idx), sym true or false, checkpoint_format (or format) gptq (v1 zero points) or
  gptq_v2, pack_dtype int32; lm_head true when the checkpoint quantizes it.
- quant_method awq: bits (w_bit) 4, group_size (q_group_size), zero_point true, version gemm.
- quant_method compressed-tensors, format pack-quantized: every config group with weights
  num_bits 4, type int, strategy group or channel, symmetric or not, static (dynamic false),
  actorder null / weight / group, and no input or output activations (W4A16); no sparsity.

Which modules are 4-bit is read from the weight files (the format's tensors are there or not):
the config's ignore lists and targets only name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.models.int4 import awq, compressed_tensors, gptq

SUPPORTED = (
    "4-bit GPTQ (quant_method gptq, bits 4, any desc_act / sym, checkpoint_format gptq or "
    "gptq_v2), AWQ (quant_method awq, version gemm, zero_point true) and compressed-tensors "
    "pack-quantized W4A16 (num_bits 4, type int, strategy group or channel, no activation "
    "quantization)"
)
INT4_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class Int4Scheme:
    """How a checkpoint's 4-bit modules are stored.

    method: gptq, awq or compressed-tensors; group_size: -1 per channel; v1_zeros: GPTQ's
    stored-zero-minus-one convention; symmetric: compressed-tensors' (no zero points stored).
    """

    method: str
    group_size: int
    v1_zeros: bool = False
    symmetric: bool = True

    @property
    def marker(self) -> str:
        """The tensor suffix whose presence makes a module 4-bit."""
        return "weight_packed" if self.method == "compressed-tensors" else "qweight"

    @property
    def suffixes(self) -> tuple[str, ...]:
        return _FORMATS[self.method].SUFFIXES

    @property
    def required(self) -> tuple[str, ...]:
        return _FORMATS[self.method].REQUIRED


_FORMATS = {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors}


class UnsupportedQuantization(ValueError):
    """A quantization_config batchgen does not run (the message says what was found)."""


def _refuse(source: str, what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"{source}: quantization_config {what} is not supported; supported: {SUPPORTED}"
    )


def is_int4_config(qc: dict[str, Any]) -> bool:
    """Whether the config belongs to a 4-bit format this package reads (parse decides if the
    rest of it is supported): gptq, awq, or compressed-tensors pack-quantized."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return qc.get("format") == "pack-quantized" or any(
            isinstance(g, dict) and g.get("format") == "pack-quantized"
            for g in (qc.get("config_groups") or {}).values()
        )
    return method in ("gptq", "awq")


def parse(qc: dict[str, Any], source: str) -> Int4Scheme:
    """The Int4Scheme of a 4-bit quantization_config; UnsupportedQuantization naming the key."""
    if not isinstance(qc, dict):
        raise _refuse(source, f"{qc!r} (not a mapping)")
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc, source)
    if method == "awq":
        return _awq(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    raise _refuse(source, f"quant_method {method!r}")


def _group_size(value: Any, source: str, key: str) -> int:
    if value == -1:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 32:
        raise _refuse(source, f"{key}={value!r} (-1 or a positive multiple of 32)")
    return value


def _gptq(qc: dict, source: str) -> Int4Scheme:
    if qc.get("bits") != 4:
        raise _refuse(source, f"bits={qc.get('bits')!r} (batchgen runs 4-bit GPTQ)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(source, f"checkpoint_format={fmt!r} (gptq or gptq_v2)")
    if qc.get("pack_dtype", "int32") != "int32":
        raise _refuse(source, f"pack_dtype={qc.get('pack_dtype')!r} (int32)")
    if qc.get("dynamic"):
        raise _refuse(source, "dynamic (per-module bits or group sizes)")
    if qc.get("is_marlin_format"):
        raise _refuse(source, "is_marlin_format=true (Marlin's repacked layout)")
    group = _group_size(qc.get("group_size", 128), source, "group_size")
    return Int4Scheme("gptq", group, v1_zeros=fmt == "gptq", symmetric=bool(qc.get("sym", True)))


def _awq(qc: dict, source: str) -> Int4Scheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(source, f"bits={bits!r} (batchgen runs 4-bit AWQ)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(source, f"version={qc.get('version')!r} (gemm)")
    if qc.get("zero_point", True) is not True:
        raise _refuse(source, f"zero_point={qc.get('zero_point')!r} (true)")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), source, "group_size")
    return Int4Scheme("awq", group, symmetric=False)


def _compressed_tensors(qc: dict, source: str) -> Int4Scheme:
    if qc.get("sparsity_config"):
        raise _refuse(source, "sparsity_config (sparse weights)")
    if qc.get("transform_config"):
        raise _refuse(source, "transform_config (rotated weights)")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(source, "kv_cache_scheme with 4-bit weights")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(source, "without config_groups")
    found = {_ct_group(name, g, qc.get("format"), source) for name, g in groups.items()}
    if len(found) > 1:
        raise _refuse(source, f"config_groups with different weight schemes {sorted(found)}")
    return found.pop()


def _ct_group(name: str, group: Any, top_format: Any, source: str) -> Int4Scheme:
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _refuse(source, f"{where}={group!r}")
    fmt = group.get("format") or top_format
    if fmt != "pack-quantized":
        raise _refuse(source, f"{where} format {fmt!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise _refuse(source, f"{where}.{key} (4-bit weights run with 16-bit activations)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(source, f"{where}.weights={w!r}")
    for key, want in (("num_bits", 4), ("type", "int"), ("dynamic", False)):
        if w.get(key, want) != want:
            raise _refuse(source, f"{where}.weights.{key}={w.get(key)!r} ({want!r})")
    if w.get("block_structure") is not None:
        raise _refuse(source, f"{where}.weights.block_structure (group or channel scales)")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "group"):
        raise _refuse(source, f"{where}.weights.actorder={actorder!r}")
    strategy = w.get("strategy")
    if strategy == "channel":
        size = -1
    elif strategy == "group":
        size = _group_size(w.get("group_size"), source, f"{where}.weights.group_size")
    else:
        raise _refuse(source, f"{where}.weights.strategy={strategy!r} (group or channel)")
    return Int4Scheme("compressed-tensors", size, symmetric=bool(w.get("symmetric", True)))
