"""Packed token bitmasks (structured output): unpack and apply, Triton kernel and references.

A bitmask row holds one bit per vocabulary id, packed into int32 words: token i is allowed when
bit i % 32 of word i // 32 is set, so a [B, V] mask is [B, ceil(V / 32)] int32 (the layout the
grammar library fills, 19 KB a row at V = 151,936 instead of 152 KB of bools). A disallowed
token's logit becomes -inf, before temperature, filters and the draw.

The sampling kernels (sampling.py, top_k_top_p.py) read the mask themselves as they read the
logits; `apply_token_bitmask` is for the paths that first copy the logits to float32 anyway
(greedy rows, penalties, logprobs): the mask goes into that copy, no extra pass.
"""

from __future__ import annotations

import torch

from .launch import check_launchable, tl, triton

_BLOCK = 2048


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one mask row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def unpack_bitmask_ref(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 packed mask -> [B, V] bool (True: allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask.to(torch.int32)[:, :, None] >> bits) & 1  # [B, W, 32]
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> float32 copy with -inf where the mask bit is 0."""
    allowed = unpack_bitmask_ref(bitmask, logits.shape[1])
    return logits.float().masked_fill(~allowed, float("-inf"))


def check_bitmask(op: str, bitmask: torch.Tensor | None, rows: int, vocab_size: int) -> None:
    """A kernel's bitmask argument: [rows, ceil(V / 32)] int32, contiguous (None passes)."""
    if bitmask is None:
        return
    shape = (rows, bitmask_words(vocab_size))
    if not (bitmask.shape == shape and bitmask.dtype == torch.int32 and bitmask.is_contiguous()):
        raise ValueError(
            f"{op}: bitmask must be {list(shape)} int32 and contiguous, got "
            f"{tuple(bitmask.shape)} {bitmask.dtype}"
        )


@triton.jit
def allowed_bits(mask_row_ptr, idx, in_row):
    # Whether vocabulary ids idx are allowed by the packed mask row at mask_row_ptr.
    word = tl.load(mask_row_ptr + (idx >> 5), mask=in_row, other=0)
    return ((word >> (idx & 31)) & 1) != 0


@triton.jit
def _apply_kernel(logits_ptr, mask_ptr, out_ptr, stride_row, stride_mask, V,
                  BLOCK: tl.constexpr):  # fmt: skip
    # Grid (B, cdiv(V, BLOCK)): one tile of one row, widened to float32, masked, stored.
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = idx < V
    x = tl.load(logits_ptr + row * stride_row + idx, mask=in_row, other=0.0).to(tl.float32)
    ok = allowed_bits(mask_ptr + row * stride_mask, idx, in_row)
    tl.store(out_ptr + row * V + idx, tl.where(ok, x, float("-inf")), mask=in_row)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Triton version of apply_token_bitmask_ref (bit-identical): one pass, the float32 copy
    the caller needed anyway with the mask in it.

    Args:
        logits: [B, V] float32/bf16/fp16, rows contiguous.
        bitmask: [B, ceil(V / 32)] int32, contiguous.

    Returns:
        [B, V] float32.
    """
    op = "apply_token_bitmask"
    if not (logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"{op}: logits must be [B, V] float, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError(f"{op}: logits rows must be contiguous, got strides {logits.stride()}")
    rows, vocab = logits.shape
    check_bitmask(op, bitmask, rows, vocab)
    check_launchable(op, logits, bitmask)
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if out.numel():
        grid = (rows, triton.cdiv(vocab, _BLOCK))
        _apply_kernel[grid](
            logits, bitmask, out, logits.stride(0), bitmask.stride(0), vocab, BLOCK=_BLOCK
        )
    return out
