"""paged_attention_decode: split-KV kernels vs reference over lengths, block sizes, GQA ratios
and split counts; the split heuristic; reference vs the prefill reference; CUDA-graph replay."""

from __future__ import annotations

import os

import pytest
import torch
from batchgen.kernels.decode_attention import (
    choose_num_splits,
    launch_decode,
    paged_attention_decode,
    paged_attention_decode_ref,
)
from batchgen.kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from batchgen.kernels.paged_attention import paged_attention_ref

DTYPES = [torch.float32, torch.float16]
if os.environ.get("TRITON_INTERPRET") != "1":
    DTYPES.append(torch.bfloat16)


def make_decode(seq_lens, hq, hk, d, bs, dtype, device, seed=0):
    """q [B, Hq, D] and a shuffled paged cache holding each sequence's seq_lens[b] keys."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // bs) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks]
    block_tables = order.view(len(seq_lens), max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, seq_lens, block_tables))


LENS = [1, 7, 16, 33, 50]  # a 1-token context, lengths on and off block boundaries


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_ref(device, close, num_splits, bs, dtype):
    args = make_decode(LENS, 4, 2, 32, bs, dtype, device)
    out = paged_attention_decode(*args, 32**-0.5, num_splits=num_splits)
    assert out.shape == args[0].shape and out.dtype == dtype
    close(out, paged_attention_decode_ref(*args, 32**-0.5), dtype)


@pytest.mark.parametrize("hq, hk, d", [(2, 2, 16), (8, 2, 64), (6, 3, 32), (8, 1, 128)])
def test_decode_gqa_and_head_dims(device, close, hq, hk, d):
    args = make_decode(LENS, hq, hk, d, 16, torch.float16, device)
    out = paged_attention_decode(*args, d**-0.5, num_splits=2)
    close(out, paged_attention_decode_ref(*args, d**-0.5), torch.float16)


def test_decode_more_splits_than_tiles(device, close):
    # Most splits of the short sequences are empty; the reduce must ignore them.
    args = make_decode([1, 3, 20], 4, 2, 32, 8, torch.float32, device)
    out = paged_attention_decode(*args, 0.2, num_splits=8)
    close(out, paged_attention_decode_ref(*args, 0.2), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_empty_sequence_gives_zeros(device, num_splits):
    # CUDA-graph padding rows may carry seq_len 0: zeros, never NaN.
    q, k_cache, v_cache, seq_lens, block_tables = make_decode(
        [5, 9], 4, 2, 32, 8, torch.float32, device
    )
    seq_lens[1] = 0
    out = paged_attention_decode(q, k_cache, v_cache, seq_lens, block_tables, 0.2, num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    expected = paged_attention_decode_ref(q, k_cache, v_cache, seq_lens, block_tables, 0.2)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("block_n, num_splits", [(64, 1), (64, 2), (32, 4)])
def test_decode_tile_shapes(device, close, block_n, num_splits):
    # Key tiles larger than the cache block (8), as on the GPU, and more splits than needed.
    args = make_decode([1, 60, 130, 200], 4, 2, 32, 8, torch.float32, device)
    out = launch_decode(*args, 0.2, num_splits, block_n, 4, 1)
    close(out, paged_attention_decode_ref(*args, 0.2), torch.float32)


def test_decode_rejects_bad_args(device):
    q, k_cache, v_cache, seq_lens, block_tables = make_decode(
        [5, 9], 4, 2, 32, 8, torch.float32, device
    )
    with pytest.raises(ValueError, match="seq_lens must be"):
        paged_attention_decode(q, k_cache, v_cache, seq_lens.long(), block_tables, 0.1)
    with pytest.raises(ValueError, match="multiple of Hk"):
        paged_attention_decode(q[:, :3], k_cache, v_cache, seq_lens, block_tables, 0.1)


def test_choose_num_splits():
    cpu = torch.device("cpu")  # counts as 132 SMs
    assert choose_num_splits(256, 8, 4096, cpu) == 1  # the batch fills the GPU already
    assert choose_num_splits(4, 8, 8192, cpu) == 9  # 264 programs wanted over 32 groups
    assert choose_num_splits(1, 8, 100, cpu) == 1  # too short to split
    assert choose_num_splits(1, 1, 1 << 20, cpu) == 32  # capped


def test_ref_matches_prefill_ref():
    q, k_cache, v_cache, seq_lens, block_tables = make_decode(
        LENS, 6, 2, 16, 8, torch.float32, "cpu"
    )
    cu = torch.arange(len(LENS) + 1, dtype=torch.int32)
    expected = paged_attention_ref(q, k_cache, v_cache, cu, seq_lens, block_tables, 0.3, 1)
    out = paged_attention_decode_ref(q, k_cache, v_cache, seq_lens, block_tables, 0.3)
    torch.testing.assert_close(out, expected)
    # And against a plain softmax over the gathered keys, sequence 3 head 5 (kv head 1).
    b, h, n = 3, 5, LENS[3]
    pos = torch.arange(n)
    keys = k_cache[block_tables[b, pos // 8].long(), pos % 8, 1].double()
    vals = v_cache[block_tables[b, pos // 8].long(), pos % 8, 1].double()
    probs = torch.softmax(keys @ q[b, h].double() * 0.3, dim=0)
    torch.testing.assert_close(out[b, h].double(), probs @ vals, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_realistic(close, dtype, batch):
    # Llama-3-8B heads, contexts up to ~2k, block size 16.
    lens = torch.randint(1, 2200, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    args = make_decode(lens, 32, 8, 128, 16, dtype, "cuda")
    out = paged_attention_decode(*args, 128**-0.5, max_seq_len=2200)
    close(out, paged_attention_decode_ref(*args, 128**-0.5), dtype)


@pytest.mark.gpu
def test_decode_cuda_graph_replay(close):
    # Captured once for 16 sequences of up to 256 tokens; lengths, block tables, queries and
    # cache contents change in place between replays.
    args = make_decode([256] * 16, 32, 8, 128, 16, torch.bfloat16, "cuda")
    q, k_cache, v_cache, seq_lens, block_tables = args
    paged_attention_decode(*args, 0.1, max_seq_len=256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode(*args, 0.1, max_seq_len=256)
    for _ in range(3):
        seq_lens.copy_(torch.randint(1, 257, (16,), device="cuda", dtype=torch.int32))
        block_tables.copy_(block_tables[torch.randperm(16, device="cuda")])
        q.normal_()
        k_cache.normal_()
        v_cache.normal_()
        graph.replay()
        close(out, paged_attention_decode_ref(*args, 0.1), torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fn", [paged_attention_decode, paged_attention_decode_ref])
def test_decode_writes_into_out_view(device, close, fn, num_splits):
    # A mixed step's decode rows are the first rows of the layer's output: the op writes that
    # view in place, returns it, and leaves the rows after it as they were.
    args = make_decode(LENS, 4, 2, 32, 8, torch.float32, device)
    q = args[0]
    buf = torch.full((q.shape[0] + 3, *q.shape[1:]), 7.0, device=device)
    got = fn(*args, 0.2, num_splits, out=buf[: q.shape[0]])
    assert got.data_ptr() == buf.data_ptr()
    close(buf[: q.shape[0]], paged_attention_decode_ref(*args, 0.2), torch.float32)
    assert torch.equal(buf[q.shape[0] :], torch.full_like(buf[q.shape[0] :], 7.0))


def test_decode_rejects_bad_out(device):
    args = make_decode([5, 9], 4, 2, 32, 8, torch.float32, device)
    q = args[0]
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_decode(*args, 0.1, out=torch.empty(3, 4, 32, device=device))
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_decode(*args, 0.1, out=torch.empty_like(q, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous last dim"):
        paged_attention_decode(*args, 0.1, out=torch.empty(2, 4, 64, device=device)[..., ::2])


def to_fp8(args, scales=(0.02, 0.05)):
    """The case with its caches quantized to FP8, and the [2] kv_scale."""
    q, k_cache, v_cache, seq_lens, block_tables = args
    kv_scale = torch.tensor(scales, device=q.device)
    k8, v8 = quantize_fp8_ref(k_cache, kv_scale[0]), quantize_fp8_ref(v_cache, kv_scale[1])
    return (q, k8, v8, seq_lens, block_tables), kv_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_fp8_matches_ref(device, close, num_splits, bs, dtype):
    args, kv_scale = to_fp8(make_decode(LENS, 4, 2, 32, bs, dtype, device))
    out = paged_attention_decode(*args, 32**-0.5, num_splits=num_splits, kv_scale=kv_scale)
    assert out.dtype == dtype
    close(out, paged_attention_decode_ref(*args, 32**-0.5, kv_scale=kv_scale), dtype)


def test_decode_fp8_ref_is_attention_over_dequantized_kv():
    args, kv_scale = to_fp8(make_decode(LENS, 6, 2, 16, 8, torch.float32, "cpu"))
    q, k8, v8, seq_lens, block_tables = args
    out = paged_attention_decode_ref(*args, 0.3, kv_scale=kv_scale)
    k, v = k8.float() * 0.02, v8.float() * 0.05  # written out here: float(x) * scale
    torch.testing.assert_close(
        out, paged_attention_decode_ref(q, k, v, seq_lens, block_tables, 0.3)
    )
    with pytest.raises(ValueError, match="FP8 caches need kv_scale"):
        paged_attention_decode_ref(*args, 0.3)


def test_decode_fp8_empty_sequence_and_tiles(device, close):
    args, kv_scale = to_fp8(make_decode([1, 60, 130, 0], 4, 2, 32, 8, torch.float32, device))
    for block_n, num_splits in ((64, 1), (32, 4)):
        out = launch_decode(*args, 0.2, num_splits, block_n, 4, 1, kv_scale=kv_scale)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        close(out, paged_attention_decode_ref(*args, 0.2, kv_scale=kv_scale), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_fp8_realistic(close, batch):
    lens = torch.randint(1, 2200, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    args, kv_scale = to_fp8(make_decode(lens, 32, 8, 128, 16, torch.bfloat16, "cuda"))
    out = paged_attention_decode(*args, 128**-0.5, max_seq_len=2200, kv_scale=kv_scale)
    ref = paged_attention_decode_ref(*args, 128**-0.5, kv_scale=kv_scale)
    close(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_decode_fp8_cuda_graph_replay(close):
    # The scales are read from device memory at replay: changing them in place (calibration)
    # needs no new capture.
    args, kv_scale = to_fp8(make_decode([256] * 16, 32, 8, 128, 16, torch.bfloat16, "cuda"))
    paged_attention_decode(*args, 0.1, max_seq_len=256, kv_scale=kv_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode(*args, 0.1, max_seq_len=256, kv_scale=kv_scale)
    for scales in ((0.02, 0.05), (0.5, 0.001)):
        kv_scale.copy_(torch.tensor(scales))
        graph.replay()
        close(out, paged_attention_decode_ref(*args, 0.1, kv_scale=kv_scale), torch.bfloat16)
    assert args[1].dtype == FP8_DTYPE
