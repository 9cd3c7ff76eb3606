"""paged_attention_decode_rope: the split kernel's ROPE mode (q/k-norm, rotary and the cache
write folded into decode attention) vs its reference and vs the two unfused kernels."""

from __future__ import annotations

import os

import pytest
import torch
from batchgen.kernels.decode_attention import paged_attention_decode
from batchgen.kernels.decode_rope import (
    paged_attention_decode_rope,
    paged_attention_decode_rope_ref,
)
from batchgen.kernels.rope_store import rope_and_store_kv
from batchgen.kernels.rotary import build_cos_sin_cache

DTYPES = [torch.float32, torch.float16]
if os.environ.get("TRITON_INTERPRET") != "1":
    DTYPES.append(torch.bfloat16)  # the interpreter cannot run a bf16 tl.dot


def _case(lens, hq, hk, d, bs, dtype, device, qk_norm, seed=0):
    """One decode step: qkv rows for tokens at positions lens[b] - 1, a shuffled paged cache
    holding keys 0 .. lens[b] - 2 of each sequence, and the slots the new keys go to."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    width = max(-(-max(s, 1) // bs) for s in lens) + 1
    nb = b * width + 2
    tables = torch.randperm(nb, generator=g)[: b * width].view(b, width).to(torch.int32)
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    qkv = torch.randn(b, (hq + 2 * hk) * d, generator=g).to(dtype)
    positions = torch.tensor([max(s - 1, 0) for s in lens])
    slots = torch.tensor(
        [int(tables[i, (s - 1) // bs]) * bs + (s - 1) % bs if s else -1 for i, s in enumerate(lens)]
    )
    cos_sin = build_cos_sin_cache(d, 4096, 10000.0, None)
    norms = ()
    if qk_norm:
        w = (1 + 0.5 * torch.randn(2, d, generator=g)).to(dtype)
        norms = (w[0].contiguous().to(device), w[1].contiguous().to(device), 1e-6)
    t = [x.to(device) for x in (qkv, positions, cos_sin, k_cache, v_cache, slots)]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (t[0], t[1], t[2], hq, hk, t[3], t[4], t[5], seq_lens, tables.to(device), d**-0.5)
    return args, norms


def _run(fn, args, norms, **kw):
    """fn on copies of the caches: (out, k_cache, v_cache)."""
    args = list(args)
    args[5], args[6] = args[5].clone(), args[6].clone()
    out = fn(*args, *norms, **kw)
    return out, args[5], args[6]


LENS = [1, 7, 16, 17, 50]  # a first token, lengths on and off block boundaries


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_rope_matches_ref(device, close, dtype, qk_norm, num_splits):
    args, norms = _case(LENS, 4, 2, 32, 8, dtype, device, qk_norm)
    out, k_cache, v_cache = _run(paged_attention_decode_rope, args, norms, num_splits=num_splits)
    ref, k_ref, v_ref = _run(paged_attention_decode_rope_ref, args, norms)
    assert out.shape == (len(LENS), 4, 32) and out.dtype == dtype
    close(out, ref, dtype, scale=4)
    close(k_cache, k_ref, dtype, scale=4)  # the new keys, rotated in fp32 and rounded once
    assert torch.equal(v_cache, v_ref)  # new values copied; every other slot untouched
    written = args[7].cpu()
    kept = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    kept[written] = False
    kept = kept.to(device)
    assert torch.equal(k_cache.flatten(0, 1)[kept], args[5].flatten(0, 1)[kept])


@pytest.mark.parametrize("hq, hk, d, bs", [(2, 2, 16, 8), (8, 2, 64, 16), (6, 3, 24, 8),
                                           (8, 1, 128, 32)])  # fmt: skip
def test_decode_rope_gqa_and_head_dims(device, close, hq, hk, d, bs):
    # Head dims off powers of two (24: padded columns), one kv head, block sizes.
    args, norms = _case(LENS, hq, hk, d, bs, torch.float16, device, qk_norm=True, seed=1)
    out, k_cache, _ = _run(paged_attention_decode_rope, args, norms, num_splits=2)
    ref, k_ref, _ = _run(paged_attention_decode_rope_ref, args, norms)
    close(out, ref, torch.float16, scale=4)
    close(k_cache, k_ref, torch.float16, scale=4)


def test_decode_rope_padding_row(device, close):
    # CUDA-graph padding: seq_len 0 and slot -1 give zeros and write nothing.
    args, norms = _case([9, 0, 4], 4, 2, 32, 8, torch.float32, device, qk_norm=True)
    out, k_cache, v_cache = _run(paged_attention_decode_rope, args, norms, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref, k_ref, v_ref = _run(paged_attention_decode_rope_ref, args, norms)
    close(out, ref, torch.float32)
    close(k_cache, k_ref, torch.float32)
    assert torch.equal(v_cache, v_ref)


def test_decode_rope_matches_unfused_kernels(device, close):
    # The fold against what a decode step ran before it: rope_and_store_kv, then decode.
    args, norms = _case([3, 40, 25, 64], 8, 2, 64, 16, torch.float16, device, qk_norm=True)
    out, k_cache, v_cache = _run(paged_attention_decode_rope, args, norms, num_splits=2)
    qkv, pos, cos_sin, hq, hk, k0, v0, slots, seq_lens, tables, scale = args
    k1, v1 = k0.clone(), v0.clone()
    q = rope_and_store_kv(qkv, pos, cos_sin, hq, hk, k1, v1, slots, *norms)
    expected = paged_attention_decode(q, k1, v1, seq_lens, tables, scale, num_splits=2)
    close(out, expected, torch.float16, scale=2)
    close(k_cache, k1, torch.float16)
    assert torch.equal(v_cache, v1)


def test_decode_rope_rejects_bad_args(device):
    args, norms = _case([5, 9], 4, 2, 32, 8, torch.float32, device, qk_norm=True)
    bad = list(args)
    bad[0] = args[0][:, :-32]
    with pytest.raises(ValueError, match="qkv must be"):
        paged_attention_decode_rope(*bad, *norms)
    bad = list(args)
    bad[7] = args[7].int()
    with pytest.raises(ValueError, match="slot_mapping must be"):
        paged_attention_decode_rope(*bad, *norms)
    bad = list(args)
    bad[8] = args[8][:1]
    with pytest.raises(ValueError, match="seq_lens must be"):
        paged_attention_decode_rope(*bad, *norms)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        paged_attention_decode_rope(*args, norms[0], None)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, qk_norm", [(16, True), (32, False)])  # qwen3-0.6b, llama3.1-8b heads
def test_decode_rope_realistic(close, hq, qk_norm):
    lens = torch.randint(1, 2200, (64,), generator=torch.Generator().manual_seed(hq)).tolist()
    args, norms = _case(lens, hq, 8, 128, 16, torch.bfloat16, "cuda", qk_norm)
    out, k_cache, v_cache = _run(paged_attention_decode_rope, args, norms, max_seq_len=2200)
    ref, k_ref, v_ref = _run(paged_attention_decode_rope_ref, args, norms)
    close(out, ref, torch.bfloat16)
    close(k_cache, k_ref, torch.bfloat16)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.gpu
def test_decode_rope_cuda_graph_replay(close):
    # Captured once; qkv, positions, slots, lengths and caches change in place between replays.
    args, norms = _case([256] * 16, 16, 8, 128, 16, torch.bfloat16, "cuda", qk_norm=True)
    qkv, pos, cos_sin, hq, hk, k_cache, v_cache, slots, seq_lens, tables, scale = args
    fn = paged_attention_decode_rope
    fn(*args, *norms, max_seq_len=256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args, *norms, max_seq_len=256)
    for seed in range(3):
        lens = torch.randint(1, 257, (16,), generator=torch.Generator().manual_seed(seed))
        lens[0] = 256  # the same table width and cache size as the captured case
        fresh, _ = _case(lens.tolist(), 16, 8, 128, 16, torch.bfloat16, "cuda", qk_norm=True,
                         seed=seed)  # fmt: skip
        for dst, src in zip(args, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        ref, k_ref, v_ref = _run(paged_attention_decode_rope_ref, args[:5] + (k_before, v_before)
                                 + args[7:], norms)  # fmt: skip
        close(out, ref, torch.bfloat16)
        close(k_cache, k_ref, torch.bfloat16)
