"""rotary_embedding / build_cos_sin_cache: kernel vs reference, reference vs HF and a complex
rotation, the Llama 3.1 frequency rewrite vs Meta's published loop."""

from __future__ import annotations

import math

import pytest
import torch
from batchgen.kernels.launch import KERNEL_DTYPES
from batchgen.kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qk(T, hq, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(T, hk, d, generator=g).to(dtype).to(device)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T, hq, hk, d", [(5, 4, 2, 32), (3, 3, 1, 16), (4, 2, 2, 24), (9, 8, 2, 128)]
)
def test_rotary_matches_ref(device, close, T, hq, hk, d, dtype):
    cache = build_cos_sin_cache(d, 300, 10000.0, None).to(device)
    positions = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(1)).to(device)
    q, k = _qk(T, hq, hk, d, dtype, device)
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    # The kernel rounds once from fp32; the reference rounds each HF step in the input dtype.
    close(q_out, q_ref, dtype, scale=2)
    close(k_out, k_ref, dtype, scale=2)


def test_rotary_on_fused_qkv_views(device, close):
    # q and k as column slices of one [T, (Hq + 2 Hk) * D] projection, as the models produce.
    T, hq, hk, d = 6, 4, 2, 32
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=device)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
    cache = build_cos_sin_cache(d, 64, 10000.0, LLAMA3).to(device)
    positions = torch.arange(T, device=device) * 7
    for out, ref in zip(
        rotary_embedding(positions, q, k, cache), rotary_embedding_ref(positions, q, k, cache)
    ):
        close(out, ref, torch.float32)


def test_rotary_rejects_bad_args(device):
    q, k = _qk(4, 2, 2, 16, torch.float32, device)
    cache = build_cos_sin_cache(16, 8, 10000.0).to(device)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(torch.arange(4, dtype=torch.int32, device=device), q, k, cache)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rotary_embedding(torch.arange(4, device=device), q, k, cache.half())


def test_ref_matches_complex_rotation():
    # Pair (x[i], x[i + D/2]) as x[i] + j x[i + D/2], rotated by e^{j pos inv_freq[i]}.
    T, h, d, base = 7, 3, 16, 10000.0
    q, k = _qk(T, h, h, d, torch.float32, "cpu")
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 3])
    q_out, _ = rotary_embedding_ref(positions, q, k, build_cos_sin_cache(d, 256, base))
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv_freq[None, :]  # [T, D/2]
    z = torch.complex(q[..., : d // 2].double(), q[..., d // 2 :].double())
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(q_out.double(), expected, atol=1e-4, rtol=1e-4)


def test_llama3_inv_freq_matches_meta_loop():
    d, base = 128, 500000.0
    cache = build_cos_sin_cache(d, 2, base, LLAMA3)
    got = torch.atan2(cache[1, d // 2 :], cache[1, : d // 2]).double()  # angle at position 1
    # Meta's apply_scaling (llama-models, Llama 3.1), in float64.
    expected = []
    for i in range(0, d, 2):
        freq = 1.0 / base ** (i / d)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            expected.append(freq)
        elif wavelen > 8192 / 1.0:
            expected.append(freq / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * freq / 8.0 + smooth * freq)
    torch.testing.assert_close(
        got, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-5
    )


def test_linear_scaling_divides_positions():
    # Position 4p with factor 4 rotates like position p unscaled.
    plain = build_cos_sin_cache(32, 16, 10000.0)
    linear = build_cos_sin_cache(32, 64, 10000.0, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear[::4], plain, atol=1e-6, rtol=1e-6)


def test_unsupported_rope_types_are_refused():
    with pytest.raises(ValueError, match="dynamic"):
        build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        build_cos_sin_cache(64, 16, 10000.0, {"type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "linear", "factor": 2.0}])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_equals_hf(scaling, dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    d, heads, T = 64, 4, 11
    params = {"rope_theta": 500000.0, "rope_type": "default", **(scaling or {})}
    config = LlamaConfig(
        hidden_size=d * heads,
        num_attention_heads=heads,
        head_dim=d,
        max_position_embeddings=16384,
        rope_parameters=params,
    )
    positions = torch.tensor([0, 1, 2, 3, 10, 100, 1000, 4095, 8191, 9000, 16383])
    cos, sin = llama.LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions[None])
    q, k = _qk(T, heads, 2, d, dtype, "cpu")
    # HF layout [B, H, T, D]; ours [T, H, D].
    q_hf, k_hf = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    cache = build_cos_sin_cache(d, 16384, 500000.0, scaling)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    assert torch.equal(q_ref, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ref, k_hf[0].transpose(0, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_realistic(close, dtype):
    T, hq, hk, d = 8192, 32, 8, 128
    cache = build_cos_sin_cache(d, 131072, 500000.0, LLAMA3).cuda()
    positions = torch.randint(0, 131072, (T,), device="cuda")
    q, k = _qk(T, hq, hk, d, dtype, "cuda")
    q_out, k_out = rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    close(q_out, q_ref, dtype, scale=2)
    close(k_out, k_ref, dtype, scale=2)
