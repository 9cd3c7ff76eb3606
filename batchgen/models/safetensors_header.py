"""Read a safetensors file's header (names, dtypes, shapes) without reading its tensors.

Format: 8 bytes little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the data. Everything the header
says is checked against the file (sizes, offsets inside the data, known dtypes), so a config
can be compared with the weights before any allocation, and a damaged file is named.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from batchgen.models.errors import ModelLoadError

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]


def read_header(path: str) -> dict[str, TensorInfo]:
    """{tensor name: TensorInfo} from `path`'s header; ModelLoadError if it is not one."""

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{path}: not a readable safetensors file ({why}); the download may be truncated"
        )

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"header length {n} does not fit the file's {size} bytes")
            text = f.read(n)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror or e})") from e
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data_bytes = size - 8 - n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor(path, name, entry, data_bytes, bad)
    return out


def _tensor(path: str, name: str, entry, data_bytes: int, bad) -> TensorInfo:
    if not isinstance(entry, dict):
        raise bad(f"tensor {name!r} has no dtype/shape/offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_bytes or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise bad(f"tensor {name!r}'s data_offsets {offsets} do not match its shape and file")
    return TensorInfo(path, dtype, tuple(shape))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
