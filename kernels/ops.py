"""The ops models and the engine call: the Triton kernel for CUDA tensors, the torch reference
otherwise (CPU, or no Triton installed)."""

from __future__ import annotations

import torch

# Module aliases: two of the ops share their kernel module's name.
from . import activation as _activation
from . import decode_attention as _decode
from . import fused_moe as _fused_moe
from . import fused_moe_fp8 as _fused_moe_fp8
from . import kv_cache as _kv_cache
from . import logprobs as _logprobs
from . import moe_align as _moe_align
from . import moe_router as _moe_router
from . import paged_attention as _prefill
from . import penalties as _penalties
from . import rms_norm as _rms_norm
from . import rope_store as _rope_store
from . import rotary as _rotary
from . import sampling as _sampling
from . import token_bitmask as _token_bitmask
from . import top_k_top_p as _top_k_top_p
from .launch import HAS_TRITON, KERNEL_DTYPES
from .rotary import build_cos_sin_cache

__all__ = [
    "apply_token_bitmask",
    "build_cos_sin_cache",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_fp8",
    "fused_moe_fp8_warm_up",
    "fused_moe_warm_up",
    "moe_route",
    "paged_attention",
    "paged_attention_decode",
    "penalise_logits",
    "rms_norm",
    "rms_scale_rows",
    "rope_and_store_kv",
    "rotary_embedding",
    "sample_gumbel",
    "sample_top_k_top_p",
    "silu_and_mul",
    "store_kvcache",
    "token_logprobs",
    "use_triton",
    "varlen_attention",
]


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` run Triton kernels: Triton is installed and t is a CUDA tensor of a
    kernel dtype (bf16/fp16/fp32)."""
    return HAS_TRITON and t.is_cuda and t.dtype in KERNEL_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim of x [..., H]; returns x's shape and dtype."""
    if not use_triton(x):
        return _rms_norm.rms_norm_ref(x, weight, eps)
    flat = x.reshape(-1, x.shape[-1])
    return _rms_norm.rms_norm(flat, weight, eps).view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [T, H] inputs."""
    if not use_triton(x):
        return _rms_norm.fused_add_rms_norm_ref(x, residual, weight, eps)
    return _rms_norm.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by positions [T] int64 with the cache from
    build_cos_sin_cache (on the same device); returns new (q, k)."""
    if not use_triton(q):
        return _rotary.rotary_embedding_ref(positions, q, k, cos_sin_cache)
    return _rotary.rotary_embedding(positions, q, k, cos_sin_cache)


def rope_and_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rms_rows: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split qkv [T, (Hq + 2 Hk) * D], RMS-normalise the q/k heads (when the weights are given),
    rotate q and k, store k and v at slot_mapping [T] in the [NB, BS, Hk, D] caches; returns q
    [T, Hq, D]. One kernel on GPU for what rms_norm, rotary_embedding and store_kvcache do.
    With rms_rows [T, H] each qkv row is first scaled by 1 / RMS of that hidden row (an input
    RMSNorm folded into the projection). FP8 caches store k / k_scale and v / v_scale rounded
    to e4m3 (kv_scale [2] float32)."""
    args = (qkv, positions, cos_sin_cache, num_heads, num_kv_heads, k_cache, v_cache,
            slot_mapping, q_norm_weight, k_norm_weight, eps, rms_rows, rms_eps,
            kv_scale)  # fmt: skip
    if not use_triton(qkv):
        return _rope_store.rope_and_store_kv_ref(*args)
    return _rope_store.rope_and_store_kv(*args)


def rms_scale_rows(y: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, N] scaled row by row by 1 / RMS(x [T, H]), in torch on any device: the cache-free
    forward's form of the step rope_and_store_kv and silu_and_mul fold in (rms_rows)."""
    return _rms_norm.rms_scale_rows_ref(y, x, eps)


def silu_and_mul(
    x: torch.Tensor,
    rms_rows: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I] (written into out when given).
    With rms_rows [T, H] each row of x is first scaled by 1 / RMS of that hidden row (an RMSNorm
    folded into gate_up)."""
    if not use_triton(x):
        y = _activation.silu_and_mul_ref(x, rms_rows, rms_eps)
        if out is None:
            return y
        _activation.check_out("silu_and_mul", x, out)
        return out.copy_(y)
    return _activation.silu_and_mul(x, rms_rows, rms_eps, out=out)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, Hk, D] into the [NB, BS, Hk, D] caches at slot_mapping [T] (skip < 0),
    quantized with kv_scale [2] float32 when the caches are FP8."""
    if not use_triton(k):
        return _kv_cache.store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return _kv_cache.store_kvcache(k, v, k_cache, v_cache, slot_mapping, kv_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over their paged context (prefill,
    chunked prefill, mixed batches), written into out when given; FP8 caches with kv_scale [2]
    float32; see kernels/paged_attention.py for the contract."""
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q)
    if not use_triton(q):
        return _prefill.paged_attention_ref(*args, out=out, kv_scale=kv_scale)
    return _prefill.paged_attention(*args, out=out, kv_scale=kv_scale)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a ragged batch, no cache; returns [T, Hq, D]."""
    if not use_triton(q):
        return _prefill.varlen_attention_ref(q, k, v, cu_seqlens, max_seqlen, scale)
    return _prefill.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, q [B, Hq, D], over its paged context, written
    into out when given; FP8 caches with kv_scale [2] float32; CUDA-graph safe on GPU (pass
    max_seq_len, a host int, to size the KV splits)."""
    args = (q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits, max_seq_len)
    if not use_triton(q):
        return _decode.paged_attention_decode_ref(*args, out=out, kv_scale=kv_scale)
    return _decode.paged_attention_decode(*args, out=out, kv_scale=kv_scale)


def sample_gumbel(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V] by Gumbel-max with noise keyed on each request's
    (seed, step) [B] int64, after dividing each row by temperatures [B] (float32) when given,
    over the tokens a packed bitmask [B, ceil(V / 32)] int32 allows (all when None); returns
    [B] int64, identical on CPU and GPU."""
    if not (HAS_TRITON and logits.is_cuda):
        return _sampling.gumbel_argmax_ref(logits, seeds, steps, temperatures, bitmask)
    if temperatures is None or logits.dtype not in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return _sampling.gumbel_argmax(logits.contiguous(), seeds, steps, temperatures, bitmask)


def sample_top_k_top_p(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V], divided by temperatures [B] float32, by Gumbel-max
    over the row's top-k [B] int32 / top-p [B] float32 / min-p [B] float32 set (None: that
    filter off for every row) of the tokens a packed bitmask [B, ceil(V / 32)] int32 allows
    (all when None), without sorting the vocabulary on GPU; [B] int64, the same draw on CPU
    and GPU (up to float32 rounding of a nucleus boundary)."""
    if not (HAS_TRITON and logits.is_cuda):
        return _top_k_top_p.top_k_top_p_sample_ref(
            logits, seeds, steps, temperatures, top_k, top_p, min_p, bitmask
        )
    if logits.dtype not in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return _top_k_top_p.top_k_top_p_sample(
        logits.contiguous(), seeds, steps, temperatures, top_k, top_p, min_p, bitmask
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits [B, V] with -inf where the packed bitmask [B, ceil(V / 32)]
    int32 disallows a token: the float32 copy the sampler makes anyway, masked in the same
    pass."""
    if not (HAS_TRITON and logits.is_cuda):
        return _token_bitmask.apply_token_bitmask_ref(logits, bitmask)
    return _token_bitmask.apply_token_bitmask(logits.contiguous(), bitmask)


def penalise_logits(
    logits: torch.Tensor,
    ids: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on logits [N, V] float32 in place, from
    token histories ids [R, W] int32; ints [4, P] int64 (logits row, ids row, history length,
    prompt length) and floats [3, P] float32 (repetition, frequency, presence) per penalised
    row. counts: the kernel's zeroed int32 scratch [C, >= V] (kept zero), allocated here when
    None; unused by the reference. Returns logits."""
    if not (HAS_TRITON and logits.is_cuda):
        return _penalties.penalise_logits_ref(logits, ids, ints, floats)
    if counts is None:
        counts = _penalties.new_scratch(logits.shape[1], logits.device)
    return _penalties.penalise_logits(logits, ids, ints, floats, counts)


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float())[i, target_ids[i]] for logits [N, V]; returns [N] float32."""
    if not use_triton(logits):
        return _logprobs.token_logprobs_ref(logits, target_ids)
    return _logprobs.token_logprobs(logits, target_ids)


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (routing weights [T, K] weights_dtype, expert ids [T, K] int32):
    softmax in float32, top-k, optionally renormalised to sum to 1."""
    if not use_triton(logits):
        return _moe_router.topk_softmax_ref(logits, top_k, renormalize, weights_dtype)
    return _moe_router.topk_softmax(logits, top_k, renormalize, weights_dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts' SiLU MLPs of hidden [T, H] (w13 [E, 2I, H] gate then up rows, w2
    [E, H, I]) summed with topk_weights over topk_ids [T, K]; returns [T, H]. touched (a
    one-element int64 counter) gains the experts real tokens (token_slots >= 0) reach."""
    if not use_triton(hidden):
        if touched is not None:
            _moe_align.count_touched_ref(topk_ids, w13.shape[0], touched, token_slots)
        return _fused_moe.fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids)
    return _fused_moe.fused_moe(
        hidden, w13, w2, topk_weights, topk_ids, touched=touched, token_slots=token_slots
    )


def fused_moe_warm_up(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, weights_dtype: torch.dtype
) -> None:
    """Compile the fused MoE kernels for every token count ahead of a run (CUDA only; a no-op
    where the torch reference runs)."""
    if use_triton(w13):
        _fused_moe.warm_up(w13, w2, top_k, weights_dtype)


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scheme,
    touched: torch.Tensor | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe with FP8 expert weights and scales as `scheme` (an Fp8Scheme) lays them out
    (kernels/fused_moe_fp8.py); the activations quantized as the scheme says."""
    if not use_triton(hidden):
        if touched is not None:
            _moe_align.count_touched_ref(topk_ids, w13.shape[0], touched, token_slots)
        return _fused_moe_fp8.fused_moe_fp8_ref(
            hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, scheme
        )
    return _fused_moe_fp8.fused_moe_fp8(
        hidden, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, scheme,
        touched=touched, token_slots=token_slots,
    )  # fmt: skip


def fused_moe_fp8_warm_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    weights_dtype: torch.dtype,
    scheme,
) -> None:
    """Compile the FP8 fused MoE kernels for every token count ahead of a run (CUDA only;
    hidden: any tensor of the activations' dtype and device)."""
    if use_triton(hidden):
        _fused_moe_fp8.warm_up(hidden.dtype, w13, w13_scale, w2, w2_scale, top_k, weights_dtype,
                               scheme)  # fmt: skip
