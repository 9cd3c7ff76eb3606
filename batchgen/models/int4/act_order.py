"""Act-order (desc_act) weights: input channels listed by g_idx in any order, sorted into group
order at load so that every group's rows are contiguous in the packed layout."""

from __future__ import annotations

import torch

from batchgen.models.int4 import nibbles


def group_order(g_idx: torch.Tensor | None, k: int, group: int, where: str) -> torch.Tensor | None:
    """The permutation that sorts input channels by group (None when g_idx already lists
    channel k in group k // group, or names one group for all: no reordering needed).

    Raises ValueError naming `where` unless g_idx is [k] with each group holding exactly
    `group` channels (what GPTQ writes).
    """
    if g_idx is None:
        return None
    if g_idx.shape != (k,):
        raise ValueError(f"{where}: g_idx has shape {tuple(g_idx.shape)}, expected [{k}]")
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx, plain) or k == group and bool((g_idx == 0).all()):
        return None
    groups = k // group
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{where}: g_idx values must lie in 0 .. {groups - 1}")
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], plain):
        raise ValueError(
            f"{where}: g_idx does not give every group exactly group_size={group} channels; "
            "batchgen reads act-order checkpoints as GPTQ writes them"
        )
    return perm


def reorder_rows(q: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """q [K, N] values 0 .. 15 in input-channel order -> packed [K/8, N] int32 in layout order
    (row k of the layout is input channel perm[k])."""
    return nibbles.pack(q if perm is None else q[perm], dim=0)
