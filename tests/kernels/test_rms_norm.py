"""rms_norm / fused_add_rms_norm: kernel vs reference, reference vs HF and the formula."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.launch import KERNEL_DTYPES
from batchgen.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for
SHAPES = [(1, 16), (7, 48), (5, 1000), (3, 4096)]


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(shape[1], generator=g)).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_ref(device, close, shape, dtype):
    x, w = _inputs(shape, dtype, device)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_fused_add_rms_norm_matches_ref(device, close, shape, dtype):
    x, w = _inputs(shape, dtype, device)
    res = _inputs(shape, dtype, device, seed=1)[0]
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    close(new_res, ref_res, dtype)
    close(normed, ref_normed, dtype)
    # Inputs are not modified.
    torch.testing.assert_close(res, _inputs(shape, dtype, device, seed=1)[0])


def test_rms_norm_strided_rows(device, close):
    # A view whose rows are spaced wider than H (e.g. one slice of a fused projection).
    base = _inputs((6, 96), torch.float32, device)[0]
    x = base[:, 16:80]
    w = torch.rand(64, device=device)
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)


def test_rms_norm_rejects_bad_args(device):
    x, w = _inputs((4, 32), torch.float32, device)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        rms_norm(x.t(), w[:4], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x[:2], w, 1e-6)


def test_ref_matches_formula():
    x, w = _inputs((9, 80), torch.float32, "cpu")
    expected = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_equals_hf_llama_rms_norm(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, w = _inputs((6, 64), dtype, "cpu")
    res = _inputs((6, 64), dtype, "cpu", seed=3)[0]
    hf = llama.LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert torch.equal(rms_norm_ref(x, w, 1e-6), hf(x))
        # HF decoder layer: residual = hidden; hidden = residual + attn_out; norm(hidden).
        normed, new_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
        assert torch.equal(new_res, res + x)
        assert torch.equal(normed, hf(res + x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_rms_norm_realistic(close, dtype, hidden):
    x, w = _inputs((4096, hidden), dtype, "cuda")
    res = _inputs((4096, hidden), dtype, "cuda", seed=1)[0]
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    close(normed, ref_normed, dtype)


def test_folded_norm_identity():
    # norm(x) @ W.T == (x @ (W * weight).T) * rsqrt(mean(x^2) + eps): the identity that lets the
    # model fold its norms into the next projection and scale rows afterwards (fp64 values; both
    # references take the statistics in fp32, as HF does).
    from batchgen.kernels.activation import silu_and_mul_ref
    from batchgen.kernels.rms_norm import rms_scale_rows_ref

    g = torch.Generator().manual_seed(0)
    x = 4 * torch.randn(7, 32, generator=g, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(32, generator=g, dtype=torch.float64)
    proj = torch.randn(40, 32, generator=g, dtype=torch.float64)
    plain = rms_norm_ref(x, w, 1e-6) @ proj.T
    folded = rms_scale_rows_ref(x @ (proj * w).T, x, 1e-6)
    torch.testing.assert_close(folded, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(x @ (proj * w).T, plain, atol=1e-3)  # the scale matters
    torch.testing.assert_close(
        silu_and_mul_ref(x @ (proj * w).T, rms_rows=x, rms_eps=1e-6),
        silu_and_mul_ref(plain),
        atol=1e-4,
        rtol=1e-4,
    )
