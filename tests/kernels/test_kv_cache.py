"""store_kvcache: kernel vs reference vs a plain loop."""

from __future__ import annotations

import pytest
import torch
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
    with pytest.raises(ValueError, match="share a dtype"):
        store_kvcache(k.half(), v.half(), k_cache, v_cache, slots)


def test_ref_matches_loop():
    k, v, k_cache, v_cache, slots = _case(9, 3, 8, 2, 16, torch.float32, "cpu")
    k_loop, v_loop = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_loop[slot // 8, slot % 8] = k[t]
            v_loop[slot // 8, slot % 8] = v[t]
    assert torch.equal(k_cache, k_loop) and torch.equal(v_cache, v_loop)


@pytest.mark.gpu
def test_store_kvcache_realistic():
    k, v, k_cache, v_cache, slots = _case(8192, 4096, 16, 8, 128, torch.bfloat16, "cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
