"""A 4-bit checkpoint as its headers show it: the scheme from config.json's quantization_config,
which modules hold the format's tensors, and those tensors' names, shapes and dtypes checked
against the 16-bit shapes the config gives each projection (no weights are read)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.models.int4.scheme import (
    INT4_METHODS,
    SUPPORTED,
    Int4Scheme,
    UnsupportedQuantization,
    is_int4_config,
    parse,
)
from batchgen.models.safetensors_header import TensorInfo

_INT = ("I32",)
_FLOAT = ("F16", "BF16", "F32")


@dataclass
class Int4Checkpoint:
    """scheme; modules: HF module name -> (out, in) of its 16-bit weight; tensors: the
    format's tensors the headers hold (checked): name -> its file, dtype and shape."""

    scheme: Int4Scheme
    source: str
    modules: dict[str, tuple[int, int]] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def refuse_unless_int4(qc, source: str) -> None:
    """Raise UnsupportedQuantization for a quantization_config that is not a 4-bit format."""
    if not isinstance(qc, dict) or not is_int4_config(qc):
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        fmt = f", format {qc.get('format')!r}" if isinstance(qc, dict) and "format" in qc else ""
        known = method in INT4_METHODS
        raise UnsupportedQuantization(
            f"{source}: quantization_config quant_method {method!r}{fmt} is not supported"
            f"{' with these settings' if known else ''}; supported: {SUPPORTED}"
        )


def read_int4_checkpoint(
    qc: dict, source: str, weights: dict[str, tuple[int, int]], headers: dict
) -> Int4Checkpoint:
    """The Int4Checkpoint of quantization_config `qc` (from `source`) and the weight files'
    `headers` (name -> TensorInfo); `weights`: every projection's HF weight name -> the (out,
    in) shape the config gives it.

    Raises:
        UnsupportedQuantization: the config is not a supported 4-bit scheme.
        ValueError: a tensor is missing, misshapen or of the wrong dtype, or a module the
            checkpoint quantizes is not a projection batchgen can run in 4 bits (the message
            names the file and tensor).
    """
    refuse_unless_int4(qc, source)
    scheme = parse(qc, source)
    marker = "." + scheme.marker
    out = Int4Checkpoint(scheme, source)
    found = sorted(n[: -len(marker)] for n in headers if n.endswith(marker))
    if not found:
        raise ValueError(
            f"{source}: quantization_config is {scheme.method}, but no tensor of the weights "
            f"ends in {marker}; the config and weights do not belong together"
        )
    for module in found:
        shape = weights.get(module + ".weight")
        if shape is None:
            raise ValueError(
                f"{headers[module + marker].file}: {module} is stored in 4 bits, but it is "
                "not a projection batchgen runs in 4 bits (the embedding and a tied LM head "
                "stay 16-bit)"
            )
        out.modules[module] = shape
        names = _check_module(scheme, module, shape, headers)
        out.tensors.update({name: headers[name] for name in names})
    return out


def _check_module(scheme: Int4Scheme, module: str, shape, headers: dict) -> list[str]:
    """The module's format tensors, each checked; their names."""
    n, k = shape
    group = k if scheme.group_size == -1 else scheme.group_size
    if k % group:
        raise ValueError(
            f"{headers[module + '.' + scheme.marker].file}: {module} has {k} input channels, "
            f"not a multiple of group_size {group}"
        )
    g, n8, k8 = k // group, -(-n // 8), -(-k // 8)
    if scheme.method == "gptq":
        want = {"qweight": ([(k8, n)], _INT), "qzeros": ([(g, n8)], _INT),
                "scales": ([(g, n)], _FLOAT), "g_idx": ([(k,)], _INT)}  # fmt: skip
    elif scheme.method == "awq":
        want = {"qweight": ([(k, n8)], _INT), "qzeros": ([(g, n8)], _INT),
                "scales": ([(g, n)], _FLOAT)}  # fmt: skip
    else:
        want = {"weight_packed": ([(n, k8)], _INT), "weight_scale": ([(n, g)], _FLOAT),
                "weight_shape": ([(2,)], ("I64", "I32")), "weight_g_idx": ([(k,)], _INT),
                "weight_zero_point": ([(n8, g), (n, g)], ("I32", "I8"))}  # fmt: skip
    names = []
    for suffix, (shapes, dtypes) in want.items():
        name = f"{module}.{suffix}"
        info = headers.get(name)
        if info is None:
            if suffix in scheme.required or (
                suffix == "weight_zero_point" and not scheme.symmetric
            ):
                raise ValueError(
                    f"{headers[module + '.' + scheme.marker].file}: the weights lack {name} "
                    f"({scheme.method} {n} x {k} in groups of {group})"
                )
            continue
        if info.shape not in shapes or info.dtype not in dtypes:
            raise ValueError(
                f"{info.file}: tensor {name!r} is {info.dtype} {info.shape}; a {scheme.method} "
                f"module of {n} outputs and {k} inputs in groups of {group} needs "
                f"{' or '.join(map(str, shapes))} of {'/'.join(dtypes)}"
            )
        names.append(name)
    if f"{module}.weight" in headers:
        raise ValueError(
            f"{headers[module + '.weight'].file}: {module} has both a 16-bit weight and "
            f"{scheme.method} tensors"
        )
    return names
