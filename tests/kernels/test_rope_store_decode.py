"""rope_store_decode: the decode kernel doing its rows' prologue (row scale, q/k-norm, rotary,
the cache write) against its reference, and against rope_and_store_kv then
paged_attention_decode run in turn."""

from __future__ import annotations

import os

import pytest
import torch
from batchgen.kernels.decode_attention import (
    paged_attention_decode,
    rope_store_decode,
    rope_store_decode_ref,
)
from batchgen.kernels.rope_store import rope_and_store_kv
from batchgen.kernels.rotary import build_cos_sin_cache

DTYPES = [torch.float32, torch.float16]
if os.environ.get("TRITON_INTERPRET") != "1":
    DTYPES.append(torch.bfloat16)

# Context lengths: 1 key, on and off block boundaries, and a padding row (0: no key, no store).
LENS = [1, 7, 16, 33, 50, 0]


def make_case(lens, hq, hk, d, bs, dtype, device, qk_norm=False, hidden=None, seed=0):
    """Decode rows over a shuffled paged cache: row b's token sits at position lens[b] - 1, in
    the slot its block table gives that position (slot -1 for a padding row). Returns the
    positional arguments of rope_store_decode (scale included) and its keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_blocks = max(-(-n // bs) for n in lens) + 1
    num_blocks = B * max_blocks + 3
    order = torch.randperm(num_blocks, generator=g)[: B * max_blocks]
    block_tables = order.view(B, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
    qkv = torch.randn(B, (hq + 2 * hk) * d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = (seq_lens.long() - 1).clamp(min=0)
    slots = [int(block_tables[b, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1
             for b, n in enumerate(lens)]  # fmt: skip
    cos_sin = build_cos_sin_cache(d, max(lens) + 1, 10000.0, None)  # positions < max_pos
    kwargs = {}
    if qk_norm:
        w = (1 + 0.5 * torch.randn(2, d, generator=g)).to(dtype)
        kwargs.update(q_norm_weight=w[0].contiguous(), k_norm_weight=w[1].contiguous(), eps=1e-6)
    if hidden:
        kwargs.update(rms_rows=(3 * torch.randn(B, hidden, generator=g)).to(dtype), rms_eps=1e-5)
    args = [qkv, positions, cos_sin, hq, hk, k_cache, v_cache, torch.tensor(slots), seq_lens,
            block_tables, d**-0.5]  # fmt: skip
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return args, kwargs


def run(fn, args, kwargs):
    """fn on fresh copies of the caches: (out, k_cache, v_cache)."""
    args = list(args)
    args[5], args[6] = args[5].clone(), args[6].clone()
    out = fn(*args, **kwargs)
    return out, args[5], args[6]


def two_kernels(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots, seq_lens, block_tables,
                scale, q_norm_weight=None, k_norm_weight=None, eps=1e-6, rms_rows=None,
                rms_eps=1e-6, num_splits=None):  # fmt: skip
    """The unfused GPU path: rope_and_store_kv, then paged_attention_decode."""
    q = rope_and_store_kv(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots,
                          q_norm_weight, k_norm_weight, eps, rms_rows, rms_eps)  # fmt: skip
    return paged_attention_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("qk_norm, hidden", [(False, None), (True, None), (False, 48), (True, 40)])
def test_rope_store_decode_matches_ref(device, close, dtype, num_splits, qk_norm, hidden):
    args, kwargs = make_case(LENS, 4, 2, 32, 8, dtype, device, qk_norm, hidden)
    out, k_cache, v_cache = run(rope_store_decode, args, dict(kwargs, num_splits=num_splits))
    out_ref, k_ref, v_ref = run(rope_store_decode_ref, args, kwargs)
    assert out.shape == (len(LENS), 4, 32) and out.dtype == dtype
    close(out, out_ref, dtype, scale=4)
    close(k_cache, k_ref, dtype, scale=4)
    close(v_cache, v_ref, dtype)
    # Each live row stored its token (the caches changed exactly there); the padding row none.
    slots = args[7].cpu()
    changed = (v_ref != args[6]).flatten(0, 1).any(-1).any(-1).cpu()
    assert changed.nonzero().flatten().tolist() == sorted(slots[slots >= 0].tolist())


@pytest.mark.parametrize("hq, hk, d, bs", [(2, 2, 16, 16), (8, 2, 64, 8), (8, 1, 128, 32)])
def test_rope_store_decode_gqa_head_dims_block_sizes(device, close, hq, hk, d, bs):
    args, kwargs = make_case([3, 40, 17, 64], hq, hk, d, bs, torch.float32, device, True, 24)
    out, k_cache, _ = run(rope_store_decode, args, dict(kwargs, num_splits=2))
    out_ref, k_ref, _ = run(rope_store_decode_ref, args, kwargs)
    close(out, out_ref, torch.float32, scale=4)
    close(k_cache, k_ref, torch.float32, scale=4)


def test_rope_store_decode_other_head_dims_run_two_kernels(device, close):
    # head_dim 24 is not a power of two: the op runs rope_and_store_kv and the decode kernel.
    args, kwargs = make_case([5, 30], 6, 3, 24, 16, torch.float32, device, True, 32)
    out, k_cache, v_cache = run(rope_store_decode, args, kwargs)
    out_ref, k_ref, v_ref = run(rope_store_decode_ref, args, kwargs)
    close(out, out_ref, torch.float32, scale=4)
    close(k_cache, k_ref, torch.float32, scale=4)
    close(v_cache, v_ref, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rope_store_decode_equals_two_kernels(device, num_splits):
    # Without a reduction in the prologue (no q/k-norm, no row scale) the fused kernel rounds
    # exactly as the two kernels do: the same q, the same cache, the same output.
    args, kwargs = make_case(LENS, 4, 2, 32, 8, torch.float16, device)
    fused = run(rope_store_decode, args, dict(kwargs, num_splits=num_splits))
    unfused = run(two_kernels, args, dict(kwargs, num_splits=num_splits))
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_rope_store_decode_writes_into_out_view(device, close):
    args, kwargs = make_case(LENS, 4, 2, 32, 8, torch.float32, device, hidden=16)
    big = torch.full((len(LENS) + 3, 4, 32), 7.0, device=device)
    out, _, _ = run(rope_store_decode, args, dict(kwargs, out=big[:-3]))
    assert out.data_ptr() == big.data_ptr()
    close(big[:-3], run(rope_store_decode_ref, args, kwargs)[0], torch.float32, scale=4)
    assert torch.all(big[-3:] == 7.0)


def test_rope_store_decode_rejects_bad_args(device):
    args, kwargs = make_case([4, 9], 4, 2, 32, 8, torch.float32, device)
    bad = list(args)
    bad[8] = args[8].long()  # seq_lens must be int32
    with pytest.raises(ValueError, match="rope_store_decode: seq_lens must be"):
        rope_store_decode(*bad, **kwargs)
    bad = list(args)
    bad[0] = args[0][:, :-2]  # not (Hq + 2 Hk) * D wide
    with pytest.raises(ValueError, match=r"rope_store_decode: qkv must be \[T"):
        rope_store_decode(*bad, **kwargs)
    with pytest.raises(ValueError, match="pass both q_norm_weight and k_norm_weight"):
        rope_store_decode(*args, q_norm_weight=torch.ones(32, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("hidden", [None, 4096])
def test_rope_store_decode_realistic(close, num_splits, hidden):
    # llama3.1-8b heads (32 q, 8 kv, head_dim 128), 16-token blocks, bf16, ragged contexts up
    # to 2,000 keys: against the two kernels in turn (equal without a row scale) and the
    # reference.
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 2000, (96,), generator=g).tolist() + [0, 0]
    args, kwargs = make_case(lens, 32, 8, 128, 16, torch.bfloat16, "cuda", hidden=hidden)
    kwargs = dict(kwargs, num_splits=num_splits)
    fused = run(rope_store_decode, args, kwargs)
    unfused = run(two_kernels, args, kwargs)
    if hidden is None:
        for a, b in zip(fused, unfused):
            assert torch.equal(a, b)
    for a, b in zip(fused, unfused):
        close(a, b, torch.bfloat16)
    kwargs.pop("num_splits")
    out_ref = run(rope_store_decode_ref, args, kwargs)[0]
    close(fused[0], out_ref, torch.bfloat16, scale=2)
