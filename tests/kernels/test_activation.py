"""silu_and_mul: kernel vs reference, reference vs the formula."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.activation import silu_and_mul, silu_and_mul_ref
from batchgen.kernels.launch import KERNEL_DTYPES

DTYPES = list(KERNEL_DTYPES)  # every dtype the kernels are built for


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, inter", [(1, 8), (5, 40), (3, 1500)])
def test_silu_and_mul_matches_ref(device, close, T, inter, dtype):
    x = (3 * torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(0))).to(dtype)
    x = x.to(device)
    out = silu_and_mul(x)
    assert out.shape == (T, inter) and out.dtype == dtype
    close(out, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_strided_rows(device, close):
    base = torch.randn(4, 100, device=device)
    x = base[:, :64]
    close(silu_and_mul(x), silu_and_mul_ref(x), torch.float32)


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_and_mul(torch.randn(2, 7, device=device))


def test_ref_matches_formula():
    x = torch.randn(6, 32, dtype=torch.float64)
    gate, up = x[:, :16], x[:, 16:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_realistic(close, dtype):
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=dtype)
    close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, inter, hidden", [(1, 8, 16), (5, 40, 24), (3, 5000, 48)])
def test_silu_and_mul_row_scale_matches_ref(device, close, T, inter, hidden, dtype):
    # rms_rows: gate and up of row t scaled by 1 / RMS(rms_rows[t]) first; 5000 columns span
    # two column blocks of a row.
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(T, 2 * inter, generator=g)).to(dtype).to(device)
    rows = (5 * torch.randn(T, hidden, generator=g)).to(dtype).to(device)
    out = silu_and_mul(x, rms_rows=rows, rms_eps=1e-5)
    ref = silu_and_mul_ref(x, rms_rows=rows, rms_eps=1e-5)
    assert out.shape == (T, inter) and out.dtype == dtype
    close(out, ref, dtype)
    assert not torch.allclose(ref, silu_and_mul_ref(x))


def test_silu_and_mul_rejects_bad_rms_rows(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match=r"rms_rows must be \[3, H\]"):
        silu_and_mul(x, rms_rows=torch.randn(2, 4, device=device))
    with pytest.raises(ValueError, match="rms_rows dtype"):
        silu_and_mul(x, rms_rows=torch.randn(3, 4, device=device).half())


def test_silu_and_mul_writes_into_out(device, close):
    # out: a view at a fixed address (a strided slice of a larger buffer) receives the result.
    x = torch.randn(5, 48, device=device)
    buf = torch.full((5, 40), 7.0, device=device)
    out = buf[:, 8:32]
    got = silu_and_mul(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    close(buf[:, 8:32], silu_and_mul_ref(x), torch.float32)
    assert (buf[:, :8] == 7).all() and (buf[:, 32:] == 7).all()


def test_silu_and_mul_rejects_bad_out(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match=r"out must be \[3, 4\]"):
        silu_and_mul(x, out=torch.empty(3, 5, device=device))
    with pytest.raises(ValueError, match="contiguous rows"):
        silu_and_mul(x, out=torch.empty(4, 3, device=device).t())


def test_ops_reference_path_writes_into_out():
    # The CPU dispatch (torch reference) honours out and checks it like the kernel.
    from batchgen.kernels import ops

    x = torch.randn(4, 16)
    out = torch.empty(4, 8)
    assert ops.silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x))
    with pytest.raises(ValueError, match=r"out must be \[4, 8\]"):
        ops.silu_and_mul(x, out=torch.empty(4, 8, dtype=torch.float64))
