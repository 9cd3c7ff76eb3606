"""paged_attention / varlen_attention: kernels vs references over ragged batches, block sizes,
GQA ratios and tiles; references vs dense masked attention; a chunked prefill end to end."""

from __future__ import annotations

import os

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from batchgen.kernels.kv_cache import store_kvcache, store_kvcache_ref
from batchgen.kernels.paged_attention import (
    launch_attention,
    paged_attention,
    paged_attention_ref,
    varlen_attention,
    varlen_attention_ref,
)

# Triton's interpreter cannot run bf16 tl.dot: bf16 is covered by the GPU runs.
DTYPES = [torch.float32, torch.float16]
if os.environ.get("TRITON_INTERPRET") != "1":
    DTYPES.append(torch.bfloat16)


def make_batch(q_lens, ctx_lens, hq, hk, d, bs, dtype, device, seed=0):
    """A ragged batch whose sequence b has ctx_lens[b] cached tokens and q_lens[b] new ones,
    all already stored in a shuffled paged cache. Returns the kernel arguments and the dense
    per-sequence K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    max_blocks = max(-(-s // bs) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 2
    order = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks]
    block_tables = order.view(len(seq_lens), max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    dense = []
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, hk, d, generator=g).to(dtype)
        v = torch.randn(n, hk, d, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        store_kvcache_ref(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), block_tables)
    return tuple(t.to(device) for t in args), dense


# (q_lens, ctx_lens): whole prompts, a cached prefix + chunk, single tokens, lengths that are
# not multiples of the block or tile sizes, a 1-token prompt.
BATCHES = {
    "mixed": ([5, 33, 1, 17], [0, 20, 40, 3]),
    "prompts": ([1, 16, 30], [0, 0, 0]),
    "decode": ([1, 1, 1], [0, 9, 47]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_matches_ref(device, close, batch, bs, dtype):
    q_lens, ctx_lens = BATCHES[batch]
    args, _ = make_batch(q_lens, ctx_lens, 4, 2, 32, bs, dtype, device)
    out = paged_attention(*args, 32**-0.5, max(q_lens))
    assert out.shape == args[0].shape and out.dtype == dtype
    close(out, paged_attention_ref(*args, 32**-0.5, max(q_lens)), dtype)


@pytest.mark.parametrize("hq, hk, d", [(4, 4, 16), (8, 2, 64), (6, 3, 32), (4, 1, 128)])
def test_paged_attention_gqa_and_head_dims(device, close, hq, hk, d):
    q_lens, ctx_lens = BATCHES["mixed"]
    args, _ = make_batch(q_lens, ctx_lens, hq, hk, d, 16, torch.float16, device)
    out = paged_attention(*args, d**-0.5, max(q_lens))
    close(out, paged_attention_ref(*args, d**-0.5, max(q_lens)), torch.float16)


@pytest.mark.parametrize("tiles", [(16, 64, 4, 1), (64, 32, 4, 1), (32, 16, 4, 1)])
def test_paged_attention_tile_shapes(device, close, tiles):
    # Tiles smaller, equal and larger than the cache block (16) and than the chunks.
    q_lens, ctx_lens = ([40, 3, 70], [25, 100, 0])
    args, _ = make_batch(q_lens, ctx_lens, 4, 2, 32, 16, torch.float32, device)
    out = launch_attention(*args, 0.2, max(q_lens), True, tiles)
    close(out, paged_attention_ref(*args, 0.2, max(q_lens)), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_attention_matches_ref(device, close, dtype):
    g = torch.Generator().manual_seed(0)
    lens = [5, 33, 1, 17]
    T = sum(lens)
    q = torch.randn(T, 4, 32, generator=g).to(dtype).to(device)
    k = torch.randn(T, 2, 32, generator=g).to(dtype).to(device)
    v = torch.randn(T, 2, 32, generator=g).to(dtype).to(device)
    cu = torch.tensor([0, 5, 38, 39, 56], dtype=torch.int32, device=device)
    out = varlen_attention(q, k, v, cu, 33, 0.25)
    close(out, varlen_attention_ref(q, k, v, cu, 33, 0.25), dtype)


def test_chunked_prefill_end_to_end(device, close):
    # Prefill one prompt in two chunks through store_kvcache + paged_attention; the outputs
    # must equal one cache-free pass over the whole prompt.
    g = torch.Generator().manual_seed(1)
    n, split, hq, hk, d, bs = 45, 19, 4, 2, 32, 8
    q = torch.randn(n, hq, d, generator=g).to(device)
    k = torch.randn(n, hk, d, generator=g).to(device)
    v = torch.randn(n, hk, d, generator=g).to(device)
    k_cache = torch.zeros(12, bs, hk, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[7, 2, 11, 0, 5, 9, 1]], dtype=torch.int32, device=device)
    pos = torch.arange(n, device=device)
    slots = block_tables[0, pos // bs].long() * bs + pos % bs
    outs = []
    for lo, hi in ((0, split), (split, n)):
        store_kvcache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=device)
        outs.append(
            paged_attention(q[lo:hi], k_cache, v_cache, cu, seq_lens, block_tables, 0.2, hi - lo)
        )
    full = varlen_attention_ref(
        q, k, v, torch.tensor([0, n], dtype=torch.int32, device=device), n, 0.2
    )
    close(torch.cat(outs), full, torch.float32)


def test_paged_attention_rejects_bad_args(device):
    args, _ = make_batch([3], [2], 4, 2, 32, 8, torch.float32, device)
    q, k_cache, v_cache, cu, seq_lens, block_tables = args
    with pytest.raises(ValueError, match="multiple of Hk"):
        paged_attention(q[:, :3], k_cache, v_cache, cu, seq_lens, block_tables, 0.1, 3)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, k_cache, v_cache, cu, seq_lens.long(), block_tables, 0.1, 3)
    with pytest.raises(ValueError, match="caches hold torch.float32; expected torch.float16"):
        paged_attention(q.half(), k_cache, v_cache, cu, seq_lens, block_tables, 0.1, 3)
    fp8 = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="FP8 caches need kv_scale"):
        paged_attention(q, *fp8, cu, seq_lens, block_tables, 0.1, 3)


def _dense_attention(q, k, v, scale):
    # Independent check: SDPA in float64 with an explicit bottom-right causal mask.
    lq, lk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    mask = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def test_refs_match_dense_attention():
    q_lens, ctx_lens = BATCHES["mixed"]
    args, dense = make_batch(q_lens, ctx_lens, 6, 2, 16, 8, torch.float32, "cpu")
    out = paged_attention_ref(*args, 0.3, max(q_lens))
    cu = args[3].tolist()
    for b, (k, v) in enumerate(dense):
        expected = _dense_attention(args[0][cu[b] : cu[b + 1]], k, v, 0.3)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    # Cache-free reference: every sequence is whole (no cached prefix).
    q = args[0]
    k = torch.cat([k[-n:] for (k, _), n in zip(dense, q_lens)])
    v = torch.cat([v[-n:] for (_, v), n in zip(dense, q_lens)])
    out = varlen_attention_ref(q, k, v, args[3], max(q_lens), 0.3)
    for b in range(len(q_lens)):
        sl = slice(cu[b], cu[b + 1])
        torch.testing.assert_close(
            out[sl].double(), _dense_attention(q[sl], k[sl], v[sl], 0.3), atol=1e-5, rtol=1e-5
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_realistic(close, dtype):
    # Llama-3-8B attention: a whole 2k prompt, a 1.5k cached prefix + 512 chunk, decode-like
    # single tokens after 2k, and a short prompt, in one mixed batch.
    q_lens, ctx_lens = [2048, 512, 1, 1, 300], [0, 1536, 2047, 1000, 0]
    args, _ = make_batch(q_lens, ctx_lens, 32, 8, 128, 16, dtype, "cuda")
    out = paged_attention(*args, 128**-0.5, 2048)
    close(out, paged_attention_ref(*args, 128**-0.5, 2048), dtype)


@pytest.mark.gpu
def test_varlen_attention_realistic(close):
    g = torch.Generator().manual_seed(0)
    lens = [2048, 700, 1300]
    T = sum(lens)
    q = torch.randn(T, 32, 128, generator=g).bfloat16().cuda()
    k = torch.randn(T, 8, 128, generator=g).bfloat16().cuda()
    v = torch.randn(T, 8, 128, generator=g).bfloat16().cuda()
    cu = torch.tensor([0, 2048, 2748, 4048], dtype=torch.int32, device="cuda")
    out = varlen_attention(q, k, v, cu, 2048, 128**-0.5)
    close(out, varlen_attention_ref(q, k, v, cu, 2048, 128**-0.5), torch.bfloat16)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref])
def test_paged_attention_writes_into_out_view(device, close, fn):
    # A mixed step's prompt rows follow its decode rows: the op writes that tail view of the
    # layer's output in place, returns it, and leaves the rows before it as they were.
    q_lens, ctx_lens = BATCHES["mixed"]
    args, _ = make_batch(q_lens, ctx_lens, 4, 2, 32, 8, torch.float32, device)
    q = args[0]
    buf = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0, device=device)
    got = fn(*args, 0.2, max(q_lens), out=buf[2:])
    assert got.data_ptr() == buf[2:].data_ptr()
    close(buf[2:], paged_attention_ref(*args, 0.2, max(q_lens)), torch.float32)
    assert torch.equal(buf[:2], torch.full_like(buf[:2], 7.0))
    with pytest.raises(ValueError, match="out must be"):
        fn(*args, 0.2, max(q_lens), out=buf)


def to_fp8(args, scales=(0.02, 0.05)):
    """The batch with its caches quantized to FP8 (values up to ~4 / 0.02 = 200, inside e4m3's
    448), and the [2] kv_scale."""
    q, k_cache, v_cache, *rest = args
    kv_scale = torch.tensor(scales, device=q.device)
    k8, v8 = quantize_fp8_ref(k_cache, kv_scale[0]), quantize_fp8_ref(v_cache, kv_scale[1])
    return (q, k8, v8, *rest), kv_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_fp8_matches_ref(device, close, batch, bs, dtype):
    q_lens, ctx_lens = BATCHES[batch]
    args, kv_scale = to_fp8(make_batch(q_lens, ctx_lens, 4, 2, 32, bs, dtype, device)[0])
    out = paged_attention(*args, 32**-0.5, max(q_lens), kv_scale=kv_scale)
    assert out.dtype == dtype
    close(out, paged_attention_ref(*args, 32**-0.5, max(q_lens), kv_scale=kv_scale), dtype)


def test_paged_attention_fp8_ref_is_attention_over_dequantized_kv():
    q_lens, ctx_lens = BATCHES["mixed"]
    args, kv_scale = to_fp8(make_batch(q_lens, ctx_lens, 6, 2, 16, 8, torch.float32, "cpu")[0])
    q, k8, v8, *meta = args
    out = paged_attention_ref(*args, 0.3, max(q_lens), kv_scale=kv_scale)
    k, v = k8.float() * 0.02, v8.float() * 0.05  # written out here: float(x) * scale
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, *meta, 0.3, max(q_lens)))
    # FP8 moves the output by about e4m3's precision, no more.
    exact = paged_attention_ref(
        *make_batch(q_lens, ctx_lens, 6, 2, 16, 8, torch.float32, "cpu")[0], 0.3, max(q_lens)
    )
    assert 0 < (out - exact).abs().max() <= exact.abs().max() / 8


def test_chunked_prefill_fp8_end_to_end(device, close):
    # Two chunks through store_kvcache + paged_attention into FP8 caches equal one pass over
    # the whole prompt's dequantized K/V: the chunk reads its own keys from the cache too.
    g = torch.Generator().manual_seed(1)
    n, split, hq, hk, d, bs = 45, 19, 4, 2, 32, 8
    q, k, v = (torch.randn(n, h, d, generator=g).to(device) for h in (hq, hk, hk))
    kv_scale = torch.tensor([0.03, 0.01], device=device)
    k_cache = torch.zeros(12, bs, hk, d, device=device).to(FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[7, 2, 11, 0, 5, 9, 1]], dtype=torch.int32, device=device)
    pos = torch.arange(n, device=device)
    slots = block_tables[0, pos // bs].long() * bs + pos % bs
    outs = []
    for lo, hi in ((0, split), (split, n)):
        store_kvcache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi], kv_scale)
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=device)
        outs.append(paged_attention(q[lo:hi], k_cache, v_cache, cu, seq_lens, block_tables,
                                    0.2, hi - lo, kv_scale=kv_scale))  # fmt: skip
    k_deq = quantize_fp8_ref(k, 0.03).float() * 0.03
    v_deq = quantize_fp8_ref(v, 0.01).float() * 0.01
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    close(torch.cat(outs), varlen_attention_ref(q, k_deq, v_deq, cu, n, 0.2), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_fp8_realistic(close, dtype):
    q_lens, ctx_lens = [2048, 512, 1, 1, 300], [0, 1536, 2047, 1000, 0]
    args, kv_scale = to_fp8(make_batch(q_lens, ctx_lens, 32, 8, 128, 16, dtype, "cuda")[0])
    out = paged_attention(*args, 128**-0.5, 2048, kv_scale=kv_scale)
    close(out, paged_attention_ref(*args, 128**-0.5, 2048, kv_scale=kv_scale), dtype)
