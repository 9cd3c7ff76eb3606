"""compressed-tensors `pack-quantized` checkpoints with 4-bit integer weights (W4A16, as the
RedHatAI / llm-compressor int4 models are published) into the packed layout.

Per quantized module `M`: M.weight_packed [N, ceil(K/8)] int32 (eight values along K, element 8i
+ j at bits 4j, each the signed value plus 8), M.weight_scale [N, G] float (G = K / group_size;
1 per channel), M.weight_shape [2] = (N, K), with asymmetric weights M.weight_zero_point (signed
zero points: [ceil(N/8), G] int32 packed along N the same way, or unpacked int8 [N, G] as older
versions wrote them), and with group act order M.weight_g_idx [K].
W[n, k] = (s[n, k] - zp[n, g]) * weight_scale[n, g], s the signed value, g the channel's group;
in the packed layout q = s + 8 and zero = zp + 8 (8 when symmetric).
"""

from __future__ import annotations

import torch

from batchgen.layers.int4_linear import PackedInt4
from batchgen.models.int4 import act_order, nibbles

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
REQUIRED = ("weight_packed", "weight_scale", "weight_shape")
_OFFSET = 8  # signed 4-bit value + 8 = the stored nibble


def to_packed(
    tensors: dict[str, torch.Tensor],
    group_size: int,
    symmetric: bool,
    where: str,
    shape: tuple[int, int] | None = None,
) -> PackedInt4:
    """One module's tensors (by suffix) as a PackedInt4; group_size -1 is per channel;
    ValueError naming `where`. shape: the (N, K) of the tensors given, where they are a
    tensor-parallel rank's block (weight_shape gives the whole module's)."""
    packed, scale, whole = (tensors[s] for s in REQUIRED)
    if whole.numel() != 2:
        raise ValueError(f"{where}.weight_shape: expected 2 values, got {whole.tolist()}")
    n, k = shape if shape is not None else (int(v) for v in whole.tolist())
    if packed.dtype != torch.int32 or packed.shape != (n, -(-k // nibbles.PACK)):
        raise ValueError(
            f"{where}.weight_packed: expected int32 [{n}, {-(-k // 8)}] for weight_shape "
            f"({n}, {k}), got {packed.dtype} {tuple(packed.shape)}"
        )
    group = k if group_size == -1 else group_size
    if k % group or k % nibbles.PACK:
        raise ValueError(f"{where}: in_features {k} is not a multiple of group_size {group}")
    groups = k // group
    if scale.shape != (n, groups) or not scale.is_floating_point():
        raise ValueError(f"{where}.weight_scale: expected float [{n}, {groups}], got "
                         f"{scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    q = nibbles.unpack(packed, dim=1)[:, :k]  # [N, K], signed value + 8
    zeros = _zeros(tensors.get("weight_zero_point"), n, groups, symmetric, scale, where)
    perm = act_order.group_order(tensors.get("weight_g_idx"), k, group, f"{where}.weight_g_idx")
    qweight = act_order.reorder_rows(q.t(), perm)
    return PackedInt4.of(qweight.contiguous(), scale.t().contiguous(), zeros, group, perm)


def _zeros(zp, n: int, groups: int, symmetric: bool, scale, where: str) -> torch.Tensor | None:
    """[G, N] zero points of the packed layout (signed zero point + 8), scale's dtype; None when
    symmetric (8 everywhere)."""
    if symmetric:
        if zp is not None and bool((zp != 0).any()):
            raise ValueError(f"{where}.weight_zero_point: nonzero, but the config says symmetric")
        return None  # zero point 8 everywhere
    if zp is None:
        raise ValueError(f"{where}: asymmetric weights need weight_zero_point")
    if zp.dtype == torch.int32 and zp.shape == (-(-n // nibbles.PACK), groups):
        signed = nibbles.unpack(zp, dim=0)[:n] - _OFFSET  # [N, G]
    elif zp.dtype == torch.int8 and zp.shape == (n, groups):
        signed = zp.to(torch.int32)
    else:
        raise ValueError(
            f"{where}.weight_zero_point: expected int32 [{-(-n // 8)}, {groups}] (packed) or "
            f"int8 [{n}, {groups}], got {zp.dtype} {tuple(zp.shape)}"
        )
    return (signed + _OFFSET).t().to(scale.dtype).contiguous()
