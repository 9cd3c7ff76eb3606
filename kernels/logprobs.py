"""Log-probability of one target token per row of logits, without materialising the fp32
log-softmax: Triton kernel and reference."""

from __future__ import annotations

import torch

from .launch import check_dtype, check_launchable, tl, triton

_BLOCK_V = 4096


@triton.jit
def _token_logprobs_kernel(logits_ptr, target_ptr, out_ptr, stride_row, V, BLOCK: tl.constexpr):
    # One program per row: per-lane online max / sum-exp over V tiles, then one log-sum-exp.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    # A finite floor instead of -inf keeps exp(m - m_new) defined while a lane has seen only
    # -inf logits (masked vocab entries or filtered tokens).
    m = tl.full([BLOCK], -3.0e38, dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    target = tl.load(target_ptr + row)
    valid = (target >= 0) & (target < V)
    # An out-of-range target yields NaN rather than reading outside the row.
    x_t = tl.load(base + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(out_ptr + row, x_t - lse)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float())[i, target_ids[i]] for each row, Triton kernel.

    Args:
        logits: [N, V] (bf16/fp16/fp32), rows contiguous.
        target_ids: [N] int64 in [0, V) (an out-of-range id gives NaN).

    Returns:
        [N] float32.
    """
    op = "token_logprobs"
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be [N, V], got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError(f"{op}: logits rows must be contiguous, got strides {logits.stride()}")
    check_dtype(op, "logits", logits)
    N = logits.shape[0]
    if not (target_ids.shape == (N,) and target_ids.dtype == torch.int64):
        raise ValueError(
            f"{op}: target_ids must be [{N}] int64, "
            f"got {tuple(target_ids.shape)} {target_ids.dtype}"
        )
    if not target_ids.is_contiguous():
        raise ValueError(f"{op}: target_ids must be contiguous")
    check_launchable(op, logits, target_ids)
    out = torch.empty((N,), dtype=torch.float32, device=logits.device)
    if N:
        _token_logprobs_kernel[(N,)](
            logits, target_ids, out, logits.stride(0), logits.shape[1], BLOCK=_BLOCK_V, num_warps=8
        )
    return out


def token_logprobs_ref(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Torch reference of token_logprobs (materialises the fp32 log-softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, target_ids[:, None]).squeeze(1)
