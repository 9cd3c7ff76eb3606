"""rope_and_store_kv: the fused prologue vs its reference and vs the three unfused kernels, into
bf16/fp16/fp32 and FP8 caches."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.kernels.kv_cache import store_kvcache
from batchgen.kernels.launch import KERNEL_DTYPES
from batchgen.kernels.rms_norm import rms_norm
from batchgen.kernels.rope_store import rope_and_store_kv, rope_and_store_kv_ref
from batchgen.kernels.rotary import build_cos_sin_cache, rotary_embedding

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for


def _case(T, hq, hk, d, dtype, device, qk_norm, nb=6, bs=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(device)
    positions = torch.randint(0, 500, (T,), generator=g).to(device)
    cos_sin = build_cos_sin_cache(d, 512, 10000.0, None).to(device)
    k_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype).to(device)
    v_cache = torch.randn(nb, bs, hk, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[1::3] = -1  # padding tokens: q is still produced, nothing is stored
    norms = ()
    if qk_norm:
        w = (1 + 0.5 * torch.randn(2, d, generator=g)).to(dtype).to(device)
        norms = (w[0].contiguous(), w[1].contiguous(), 1e-6)
    return (qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots.to(device)), norms


def _run(fn, args, norms):
    qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots = args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q = fn(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots, *norms)
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    "T, hq, hk, d", [(1, 2, 1, 16), (9, 4, 2, 32), (7, 6, 3, 24), (5, 8, 2, 128)]
)
def test_rope_and_store_kv_matches_ref(device, close, T, hq, hk, d, dtype, qk_norm):
    args, norms = _case(T, hq, hk, d, dtype, device, qk_norm)
    q, k_cache, v_cache = _run(rope_and_store_kv, args, norms)
    q_ref, k_ref, v_ref = _run(rope_and_store_kv_ref, args, norms)
    assert q.shape == (T, hq, d) and q.dtype == dtype and q.is_contiguous()
    # The kernel rotates in fp32 and rounds once; the reference rounds each step in dtype.
    close(q, q_ref, dtype, scale=4)
    close(k_cache, k_ref, dtype, scale=4)
    assert torch.equal(v_cache, v_ref)  # v is copied, never rounded
    written = args[7][args[7] >= 0]
    untouched = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    untouched[written.cpu()] = False
    untouched = untouched.to(device)
    assert torch.equal(k_cache.flatten(0, 1)[untouched], args[5].flatten(0, 1)[untouched])
    assert torch.equal(v_cache.flatten(0, 1)[untouched], args[6].flatten(0, 1)[untouched])


def _unfused(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots, *norms):
    # What the model ran before the fusion: split views, norms on [T * H, D] rows, rotary, store.
    T, d = qkv.shape[0], k_cache.shape[3]
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(T, hq, d), k.view(T, hk, d), v.view(T, hk, d)
    if norms:
        q = rms_norm(q.reshape(-1, d), norms[0], norms[2]).view(T, hq, d)
        k = rms_norm(k.reshape(-1, d), norms[1], norms[2]).view(T, hk, d)
    q, k = rotary_embedding(positions, q, k, cos_sin)
    store_kvcache(k, v, k_cache, v_cache, slots)
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_store_kv_equals_unfused_kernels(device, dtype, qk_norm):
    args, norms = _case(11, 4, 2, 32, dtype, device, qk_norm, seed=3)
    q, k_cache, v_cache = _run(rope_and_store_kv, args, norms)
    q_u, k_u, v_u = _run(_unfused, args, norms)
    # Same roundings in the same order: equal up to the fp32 sum order inside the norm.
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(q, q_u, atol=atol, rtol=0)
    torch.testing.assert_close(k_cache, k_u, atol=atol, rtol=0)
    assert torch.equal(v_cache, v_u)


def test_rope_and_store_kv_rejects_bad_args(device):
    args, norms = _case(4, 4, 2, 16, torch.float32, device, True)
    qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots = args
    with pytest.raises(ValueError, match=r"rope_and_store_kv: qkv must be \[T, \(Hq \+ 2 Hk\)"):
        rope_and_store_kv(qkv[:, :-16], positions, cos_sin, hq, hk, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_and_store_kv(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="positions must be"):
        rope_and_store_kv(qkv, positions[:2], cos_sin, hq, hk, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches hold torch.float32; expected torch.float16"):
        rope_and_store_kv(qkv.half(), positions, cos_sin, hq, hk, k_cache, v_cache, slots)
    fp8 = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="FP8 caches need kv_scale"):
        rope_and_store_kv(qkv, positions, cos_sin, hq, hk, *fp8, slots)
    with pytest.raises(ValueError, match="or neither"):
        rope_and_store_kv(qkv, positions, cos_sin, hq, hk, k_cache, v_cache, slots, norms[0])
    with pytest.raises(ValueError, match="kv heads"):
        rope_and_store_kv(qkv, positions, cos_sin, hq, 1, k_cache, v_cache, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, qk_norm, T", [(16, True, 256), (32, False, 2048)])
def test_rope_and_store_kv_realistic(hq, qk_norm, T):
    # Qwen3-0.6B (q/k-norm) and Llama-3.1-8B heads, bf16, against the unfused kernels: the same
    # roundings, so equal but for the rare last bit from the norm's fp32 sum order.
    args, norms = _case(T, hq, 8, 128, torch.bfloat16, "cuda", qk_norm, nb=T // 8, bs=16)
    q, k_cache, v_cache = _run(rope_and_store_kv, args, norms)
    q_u, k_u, v_u = _run(_unfused, args, norms)
    assert torch.equal(v_cache, v_u)
    for out, ref in ((q, q_u), (k_cache, k_u)):
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
        assert (out == ref).float().mean().item() > 0.999
    if not qk_norm:
        assert torch.equal(q, q_u) and torch.equal(k_cache, k_u)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("T, hq, hk, d, hidden", [(1, 2, 1, 16, 24), (9, 4, 2, 32, 100)])
def test_rope_and_store_kv_row_scale_matches_ref(device, close, T, hq, hk, d, hidden, dtype,
                                                 qk_norm):  # fmt: skip
    # rms_rows: every qkv row (q, k and v) scaled by 1 / RMS of its hidden row first.
    args, norms = _case(T, hq, hk, d, dtype, device, qk_norm, seed=5)
    g = torch.Generator().manual_seed(6)
    rows = (3 * torch.randn(T, hidden, generator=g)).to(dtype).to(device)
    extra = dict(rms_rows=rows, rms_eps=1e-5)
    eps = norms[2] if norms else 1e-6
    norms = norms[:2] if norms else (None, None)
    q, k_cache, v_cache = _run(lambda *a: rope_and_store_kv(*a, eps, **extra), args, norms)
    q_ref, k_ref, v_ref = _run(lambda *a: rope_and_store_kv_ref(*a, eps, **extra), args, norms)
    close(q, q_ref, dtype, scale=4)
    close(k_cache, k_ref, dtype, scale=4)
    close(v_cache, v_ref, dtype)
    # The scale is not 1: the unscaled op gives other values.
    plain, k_plain, v_plain = _run(lambda *a: rope_and_store_kv_ref(*a, eps), args, norms)
    assert not torch.allclose(v_plain, v_ref)
    if not qk_norm:  # q/k-norm undoes a per-row scale of q and k (up to eps)
        assert not torch.allclose(plain, q_ref)


def test_rope_and_store_kv_rejects_bad_rms_rows(device):
    args, _ = _case(4, 4, 2, 16, torch.float32, device, False)
    rows = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"rms_rows must be \[4, H\]"):
        rope_and_store_kv(*args, rms_rows=rows[:3])
    with pytest.raises(ValueError, match="rms_rows dtype"):
        rope_and_store_kv(*args, rms_rows=rows.half())
    with pytest.raises(ValueError, match="rms_rows rows must be contiguous"):
        rope_and_store_kv(*args, rms_rows=rows.t().contiguous().t())


def _fp8_case(T, hq, hk, d, dtype, device, qk_norm, seed=0, nb=6):
    args, norms = _case(T, hq, hk, d, dtype, device, qk_norm, nb=nb, seed=seed)
    caches = tuple(c.to(FP8_DTYPE) for c in args[5:7])
    return (*args[:5], *caches, args[7]), norms


def _close_fp8(out, ref, scale: float, atol: float = 0.0) -> None:
    """Dequantized caches equal but where the values before quantization differed (the kernel
    rotates in fp32 and rounds once, the reference rounds each step in the dtype: up to atol
    apart where a rotation cancels) or sat by an e4m3 midpoint: there within atol plus one e4m3
    step (2^-3 relative, 2^-9 * scale below the normal range)."""
    a, b = out.float() * scale, ref.float() * scale
    step = torch.maximum(a.abs(), b.abs()) / 8 + 2**-9 * scale + atol
    far = (a - b).abs() > step
    if far.any():
        i = tuple(int(j) for j in far.nonzero()[0])
        raise AssertionError(
            f"{int(far.sum())} of {a.numel()} values more than a step apart; first at {i}: "
            f"kernel {a[i].item()!r}, reference {b[i].item()!r}, allowed {step[i].item():.4g}"
        )
    same = (a == b).float().mean().item()
    assert same > 0.97, f"only {same:.4f} of the values are equal"


def _same_v_codes(v_cache, v_ref, args, hq: int, v_scale: float) -> None:
    """v is stored unrotated, so its codes equal the reference's byte for byte; a failure names
    the first differing value's token, head and column, its input and both codes."""
    got, want = v_cache.view(torch.uint8), v_ref.view(torch.uint8)
    if torch.equal(got, want):
        return
    qkv, slots = args[0], args[7]
    hk, d = v_cache.shape[2:]
    bad = (got != want).view(-1, hk, d).nonzero()
    slot, h, c = (int(j) for j in bad[0])
    tokens = (slots == slot).nonzero().flatten().tolist()
    value = qkv[tokens[0], (hq + hk + h) * d + c].float().item() if tokens else None
    raise AssertionError(
        f"{len(bad)} v codes differ; first at slot {slot} (tokens {tokens}), head {h}, column "
        f"{c}: input {value!r} / {v_scale}: kernel {int(got.view(-1, hk, d)[slot, h, c]):#04x}, "
        f"reference {int(want.view(-1, hk, d)[slot, h, c]):#04x}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("T, hq, hk, d", [(1, 2, 1, 16), (9, 4, 2, 32), (5, 8, 2, 128)])
def test_rope_and_store_kv_fp8_matches_ref(device, close, T, hq, hk, d, dtype, qk_norm):
    args, norms = _fp8_case(T, hq, hk, d, dtype, device, qk_norm)
    kv_scale = torch.tensor([0.05, 0.01], device=device)  # v values past 448 * 0.01 saturate
    q, k_cache, v_cache = _run(lambda *a: rope_and_store_kv(*a, kv_scale=kv_scale), args, norms)
    q_ref, k_ref, v_ref = _run(lambda *a: rope_and_store_kv_ref(*a, kv_scale=kv_scale), args, norms)
    assert k_cache.dtype == FP8_DTYPE
    close(q, q_ref, dtype, scale=4)  # q is never quantized
    _same_v_codes(v_cache, v_ref, args, hq, 0.01)  # v: no rotation, the same bytes
    _close_fp8(k_cache, k_ref, 0.05, atol={torch.float32: 0, torch.float16: 8e-3}.get(dtype, 8e-2))
    if dtype == torch.float32:  # both rotate in fp32 and round once: the same bytes
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    # What is stored is the unquantized op's k / k_scale, rounded to e4m3 (half a step off).
    plain = tuple(c.float().to(dtype) for c in args[5:7])
    k_plain = _run(rope_and_store_kv_ref, (*args[:5], *plain, args[7]), norms)[1]
    slots = args[7][args[7] >= 0]
    exact = k_plain.flatten(0, 1)[slots].float()
    stored = k_ref.flatten(0, 1)[slots].float() * 0.05
    assert ((stored - exact).abs() <= exact.abs() / 16 + 2**-10 * 0.05).all()


def test_rope_and_store_kv_fp8_row_scale(device):
    args, norms = _fp8_case(9, 4, 2, 32, torch.float32, device, True, seed=5)
    rows = 3 * torch.randn(9, 100, generator=torch.Generator().manual_seed(6)).to(device)
    extra = dict(rms_rows=rows, rms_eps=1e-5, kv_scale=torch.tensor([0.02, 0.02], device=device))
    q, k_cache, v_cache = _run(lambda *a: rope_and_store_kv(*a, **extra), args, norms)
    q_ref, k_ref, v_ref = _run(lambda *a: rope_and_store_kv_ref(*a, **extra), args, norms)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    _close_fp8(k_cache, k_ref, 0.02)
    _close_fp8(v_cache, v_ref, 0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, qk_norm, T", [(16, True, 256), (32, False, 2048)])
def test_rope_and_store_kv_fp8_realistic(hq, qk_norm, T):
    # Enough 8-slot blocks for every token that is stored (every third one is padding).
    args, norms = _fp8_case(T, hq, 8, 128, torch.bfloat16, "cuda", qk_norm, nb=-(-T // 8))
    kv_scale = torch.tensor([0.02, 0.01], device="cuda")
    q, k_cache, v_cache = _run(lambda *a: rope_and_store_kv(*a, kv_scale=kv_scale), args, norms)
    q_ref, k_ref, v_ref = _run(lambda *a: rope_and_store_kv_ref(*a, kv_scale=kv_scale), args, norms)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=8e-2, rtol=8e-2)
    _same_v_codes(v_cache, v_ref, args, hq, 0.01)
    _close_fp8(k_cache, k_ref, 0.02, atol=8e-2)
