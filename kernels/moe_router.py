"""Top-k softmax routing of a mixture-of-experts layer: Triton kernel and reference.

From the router's logits [T, E] (the model's dtype), as transformers' Qwen3-MoE and Mixtral
routers compute it: softmax over the experts in float32, the K largest probabilities (ties to
the lower expert id), optionally renormalised to sum to 1, optionally rounded to the logits'
dtype. One kernel instead of the five torch ops (softmax, topk, sum, divide, cast) each layer
would otherwise launch.
"""

from __future__ import annotations

import torch

from .launch import check_dtype, check_launchable, pow2, tl, triton

_BLOCK_T = 16  # tokens per program


@triton.jit(do_not_specialize=["T"])  # one kernel for every token count
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, T, E, stride_t,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
        mask=row_ok[:, None] & (cols[None, :] < E),
        other=float("-inf"),
    ).to(tl.float32)
    x = x - tl.max(x, axis=1)[:, None]
    p = tl.exp(x)
    probs = p / tl.sum(p, axis=1)[:, None]  # [BT, BE], padding columns 0
    probs = tl.where(cols[None, :] < E, probs, -1.0)  # never picked
    ks = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        # The lowest expert id holding the maximum.
        arg = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top = tl.where(ks[None, :] == k, best[:, None], top)
        idx = tl.where(ks[None, :] == k, arg[:, None], idx)
        probs = tl.where(cols[None, :] == arg[:, None], -1.0, probs)
    if RENORMALIZE:
        top = top / tl.sum(top, axis=1)[:, None]  # columns past TOP_K hold 0
    out = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    mask = row_ok[:, None] & (ks[None, :] < TOP_K)
    tl.store(weights_ptr + out, top.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, idx, mask=mask)


def _check(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(
            f"topk_softmax: logits must be [T, E] with 1 <= top_k <= E, got "
            f"{tuple(logits.shape)} and top_k={top_k}"
        )


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k experts of each token and their routing weights; Triton kernel.

    Args:
        logits: [T, E] router logits (bf16/fp16/fp32), rows contiguous.
        top_k: K, experts per token.
        renormalize: divide the K probabilities by their sum.
        weights_dtype: float32, or the logits' dtype to round the weights to.

    Returns:
        (weights [T, K] weights_dtype, ids [T, K] int32), each row by descending probability.
    """
    _check(logits, top_k)
    check_dtype("topk_softmax", "logits", logits)
    if logits.stride(1) != 1:
        raise ValueError(f"topk_softmax: logits rows must be contiguous, got {logits.stride()}")
    check_launchable("topk_softmax", logits)
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    block_e = pow2(E)
    block_t = max(1, min(_BLOCK_T, 8192 // block_e))
    _topk_softmax_kernel[(triton.cdiv(T, block_t),)](
        logits, weights, ids, T, E, logits.stride(0),
        TOP_K=top_k, BLOCK_K=pow2(top_k), BLOCK_E=block_e, BLOCK_T=block_t,
        RENORMALIZE=renormalize, num_warps=4,
    )  # fmt: skip
    return weights, ids


def topk_softmax_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of topk_softmax, as transformers' routers compute it."""
    _check(logits, top_k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids.to(torch.int32)
