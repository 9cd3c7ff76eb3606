"""store_kvcache: kernel vs reference vs a plain loop, bf16/fp16/fp32 and FP8 caches."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.kernels.kv_cache import store_kvcache, store_kvcache_ref
from batchgen.kernels.launch import KERNEL_DTYPES

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for


def _case(T, nb, bs, hk, d, dtype, device):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(T, hk, d, generator=g).to(dtype).to(device)
    v = torch.randn(T, hk, d, generator=g).to(dtype).to(device)
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype).to(device)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::3] = -1  # padding tokens are not stored
    return k, v, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, nb, bs, hk, d", [(1, 2, 8, 1, 16), (10, 4, 16, 2, 32), (7, 3, 32, 3, 24)]
)
def test_store_kvcache_matches_ref(device, T, nb, bs, hk, d, dtype):
    k, v, k_cache, v_cache, slots = _case(T, nb, bs, hk, d, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kvcache_from_fused_qkv_view(device):
    T, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=device)
    k = qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d :].view(T, hk, d)
    k_cache = torch.zeros(2, 8, hk, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 0, 15, 4], device=device)
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hk, d)[slots], k)
    assert torch.equal(v_cache.view(-1, hk, d)[slots], v)


def test_store_kvcache_rejects_bad_args(device):
    k, v, k_cache, v_cache, slots = _case(4, 2, 8, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kvcache(k, v, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="caches hold torch.float32; expected torch.float16"):
        store_kvcache(k.half(), v.half(), k_cache, v_cache, slots)
    fp8 = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="FP8 caches need kv_scale"):
        store_kvcache(k, v, *fp8, slots)
    with pytest.raises(ValueError, match="kv_scale must be 2 contiguous float32"):
        store_kvcache(k, v, *fp8, slots, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="kv_scale is for FP8 caches"):
        store_kvcache(k, v, k_cache, v_cache, slots, torch.ones(2, device=device))


def assert_same_codes(cache, ref, x, slots, scale, name: str) -> None:
    """FP8 caches byte for byte; a failure names the first differing written value: its token,
    head and column, the input, the scale and both codes (and counts differing unwritten ones)."""
    got, want = cache.view(torch.uint8), ref.view(torch.uint8)
    if torch.equal(got, want):
        return
    hk, d = x.shape[1:]
    kept = (slots >= 0).nonzero().flatten()
    rows_got = got.view(-1, hk, d)[slots[kept]]
    rows_want = want.view(-1, hk, d)[slots[kept]]
    bad = (rows_got != rows_want).nonzero()
    written = torch.zeros(got.view(-1, hk, d).shape[0], dtype=torch.bool, device=got.device)
    written[slots[kept]] = True
    stray = int((got.view(-1, hk, d)[~written] != want.view(-1, hk, d)[~written]).sum())
    msg = f"{name}: {len(bad)} written codes and {stray} unwritten ones differ"
    if len(bad):
        i, h, c = (int(j) for j in bad[0])
        t = int(kept[i])
        value = x[t, h, c].float().item()
        msg += (
            f"; first: token {t}, head {h}, column {c}: input {value!r} / scale "
            f"{scale.item()!r} = {value / scale.item()!r}: kernel {int(rows_got[i, h, c]):#04x}, "
            f"reference {int(rows_want[i, h, c]):#04x}"
        )
    raise AssertionError(msg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, nb, bs, hk, d", [(1, 2, 8, 1, 16), (10, 4, 16, 2, 32)])
def test_store_kvcache_fp8_matches_ref(device, T, nb, bs, hk, d, dtype):
    k, v, k_cache, v_cache, slots = _case(T, nb, bs, hk, d, dtype, device)
    k = k * 40  # some values past 448 / k_scale: saturated
    k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    scale = torch.tensor([0.25, 0.03], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots, scale)
    store_kvcache_ref(k, v, k_ref, v_ref, slots, scale)
    assert_same_codes(k_cache, k_ref, k, slots, scale[0], "k")
    assert_same_codes(v_cache, v_ref, v, slots, scale[1], "v")


def test_ref_matches_loop():
    k, v, k_cache, v_cache, slots = _case(9, 3, 8, 2, 16, torch.float32, "cpu")
    k_loop, v_loop = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_loop[slot // 8, slot % 8] = k[t]
            v_loop[slot // 8, slot % 8] = v[t]
    assert torch.equal(k_cache, k_loop) and torch.equal(v_cache, v_loop)


def test_fp8_ref_matches_loop():
    k, v, k_cache, v_cache, slots = _case(9, 3, 8, 2, 16, torch.float32, "cpu")
    k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    k_loop, v_loop = k_cache.float(), v_cache.float()
    store_kvcache_ref(k, v, k_cache, v_cache, slots, torch.tensor([0.5, 2.0]))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:  # the nearest e4m3 value of k / 0.5, v / 2, as torch rounds it
            k_loop[slot // 8, slot % 8] = (k[t] / 0.5).to(FP8_DTYPE).float()
            v_loop[slot // 8, slot % 8] = (v[t] / 2.0).to(FP8_DTYPE).float()
    assert torch.equal(k_cache.float(), k_loop) and torch.equal(v_cache.float(), v_loop)
    stored = k_cache.float().view(-1, 2, 16)[slots[slots >= 0]] * 0.5
    assert (stored - k[slots >= 0]).abs().max() <= k.abs().max() / 16  # e4m3: 3 mantissa bits


@pytest.mark.gpu
def test_store_kvcache_realistic():
    k, v, k_cache, v_cache, slots = _case(8192, 4096, 16, 8, 128, torch.bfloat16, "cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
def test_store_kvcache_fp8_realistic():
    k, v, k_cache, v_cache, slots = _case(8192, 4096, 16, 8, 128, torch.bfloat16, "cuda")
    k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    k[1, 0, :8] = torch.tensor([0.0, -0.0, 1e-4, -1e-4, 2e-3, 3e-6, 9.0, -9.5])  # tiny, saturated
    scale = torch.tensor([0.02, 0.05], device="cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots, scale)
    store_kvcache_ref(k, v, k_ref, v_ref, slots, scale)
    assert_same_codes(k_cache, k_ref, k, slots, scale[0], "k")
    assert_same_codes(v_cache, v_ref, v, slots, scale[1], "v")
