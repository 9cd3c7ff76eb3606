"""4-bit values packed eight to an int32 along one dimension, in a given nibble order."""

from __future__ import annotations

import torch

PACK = 8
# AWQ's GEMM layout: nibble i of a word holds element 8c + AWQ_ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack(words: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> int32 values 0 .. 15, eight per word along `dim` (nibble i at bits
    4i .. 4i + 3 holds element order[i] of the word's eight, element i without an order)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed 4-bit tensors are int32, got {words.dtype}")
    moved = words.movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nib = (moved[..., None] >> shifts) & 0xF  # [..., words, 8]: nibble i
    if order is not None:
        inverse = [order.index(j) for j in range(PACK)]  # element j sits in nibble inverse[j]
        nib = nib[..., inverse]
    return nib.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def pack(values: torch.Tensor, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack`: values 0 .. 15 (size along `dim` a multiple of 8) -> int32."""
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) > 15):
        raise ValueError("4-bit values must lie in 0 .. 15")
    if moved.shape[-1] % PACK:
        raise ValueError(f"cannot pack {moved.shape[-1]} values eight to a word")
    nib = moved.reshape(*moved.shape[:-1], -1, PACK)  # [..., words, 8]: element j
    if order is not None:
        nib = nib[..., list(order)]  # nibble i holds element order[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nib << shifts).sum(-1)
    words = words - ((words >> 31) << 32)  # the unsigned word as an int32
    return words.to(torch.int32).movedim(-1, dim)
