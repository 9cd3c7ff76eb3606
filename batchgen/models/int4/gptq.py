"""GPTQ checkpoints (AutoGPTQ / GPTQModel, 4-bit) into the packed layout.

Per quantized module `M`: M.qweight [K/8, N] int32 (eight 4-bit values along K, value 8i + j at
bits 4j of row i: already the packed layout), M.qzeros [G, N/8] int32 (eight zero points along
N, column 8c + j at bits 4j), M.scales [G, N] float, M.g_idx [K] int32 (group of each input
channel; with desc_act the channels are quantized in another order), G = K / group_size (1 for
group_size -1). W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n], where z is the stored
zero point plus one in the v1 convention (`checkpoint_format` gptq: AutoGPTQ stored zeros - 1)
and the stored value itself in gptq_v2.
"""

from __future__ import annotations

import torch

from batchgen.layers.int4_linear import PackedInt4
from batchgen.models.int4 import act_order, nibbles

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED = ("qweight", "qzeros", "scales")


def to_packed(
    tensors: dict[str, torch.Tensor], group_size: int, v1_zeros: bool, where: str
) -> PackedInt4:
    """One GPTQ module's tensors (by suffix) as a PackedInt4; ValueError naming `where`."""
    qweight, qzeros, scales = (tensors[s] for s in REQUIRED)
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{where}.{name}: expected 2-D int32, got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
    k, n = qweight.shape[0] * nibbles.PACK, qweight.shape[1]
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"{where}: in_features {k} is not a multiple of group_size {group}")
    groups = k // group
    if qzeros.shape != (groups, -(-n // nibbles.PACK)) or scales.shape != (groups, n):
        raise ValueError(
            f"{where}: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit "
            f"qweight {tuple(qweight.shape)} with group_size {group_size} (expected "
            f"[{groups}, {-(-n // 8)}] and [{groups}, {n}])"
        )
    if not scales.is_floating_point():
        raise ValueError(f"{where}.scales: expected a float tensor, got {scales.dtype}")
    zeros = nibbles.unpack(qzeros, dim=1)[:, :n] + (1 if v1_zeros else 0)
    perm = act_order.group_order(tensors.get("g_idx"), k, group, f"{where}.g_idx")
    if perm is not None:
        qweight = act_order.reorder_rows(nibbles.unpack(qweight, dim=0), perm)
    return PackedInt4.of(qweight.contiguous(), scales, zeros.to(scales.dtype), group, perm)
