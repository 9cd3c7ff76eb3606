"""AWQ checkpoints (AutoAWQ, version GEMM, 4-bit with zero points) into the packed layout.

Per quantized module `M`: M.qweight [K, N/8] int32 and M.qzeros [G, N/8] int32, each word holding
eight 4-bit values along N in AWQ's interleaved order (nibble i is column 8c + AWQ_ORDER[i]),
M.scales [G, N] float, G = K / group_size. W[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n].
"""

from __future__ import annotations

import torch

from batchgen.layers.int4_linear import PackedInt4
from batchgen.models.int4 import nibbles

SUFFIXES = ("qweight", "qzeros", "scales")
REQUIRED = SUFFIXES


def to_packed(tensors: dict[str, torch.Tensor], group_size: int, where: str) -> PackedInt4:
    """One AWQ module's tensors (by suffix) as a PackedInt4; ValueError naming `where`."""
    qweight, qzeros, scales = (tensors[s] for s in REQUIRED)
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{where}.{name}: expected 2-D int32, got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
    k, n = qweight.shape[0], qweight.shape[1] * nibbles.PACK
    group = k if group_size == -1 else group_size
    if k % group or k % nibbles.PACK:
        raise ValueError(f"{where}: in_features {k} is not a multiple of group_size {group}")
    groups = k // group
    if qzeros.shape != (groups, n // nibbles.PACK) or scales.shape != (groups, n):
        raise ValueError(
            f"{where}: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit "
            f"qweight {tuple(qweight.shape)} with group_size {group_size} (expected "
            f"[{groups}, {n // 8}] and [{groups}, {n}])"
        )
    if not scales.is_floating_point():
        raise ValueError(f"{where}.scales: expected a float tensor, got {scales.dtype}")
    q = nibbles.unpack(qweight, dim=1, order=nibbles.AWQ_ORDER)  # [K, N]
    zeros = nibbles.unpack(qzeros, dim=1, order=nibbles.AWQ_ORDER)  # [G, N]
    return PackedInt4.of(nibbles.pack(q, dim=0), scales, zeros.to(scales.dtype), group)
