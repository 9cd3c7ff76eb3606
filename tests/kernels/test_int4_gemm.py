"""int4_gemm and dequantize_int4: kernels vs references, references vs the layout's definition."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.int4_dequant import dequantize_int4, dequantize_int4_ordered_ref
from batchgen.kernels.int4_gemm import (
    GemmConfig,
    dequantize_int4_ref,
    int4_gemm,
    int4_gemm_ref,
    pack_int4_ref,
    unpack_int4_ref,
)


def packed_weight(k: int, n: int, group: int, seed: int = 0, dtype=torch.float16):
    """Random q (0..15), scales and zero points (0..16, as the GPTQ v1 convention allows)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 17, (k // group, n), generator=g).to(dtype)
    return q, pack_int4_ref(q), scales, zeros


def test_pack_is_the_layout_bit_by_bit():
    # Bits 4j .. 4j + 3 of word [i, n] hold q[8i + j, n], written out one value at a time.
    q, qweight, _, _ = packed_weight(16, 5, 16)
    for i in range(2):
        for n in range(5):
            word = int(qweight[i, n]) & 0xFFFFFFFF
            expected = sum(int(q[8 * i + j, n]) << (4 * j) for j in range(8))
            assert word == expected
    assert torch.equal(unpack_int4_ref(qweight), q.to(torch.int32))


def test_dequantize_ref_is_the_definition():
    q, qweight, scales, zeros = packed_weight(64, 6, 32, seed=1)
    w = dequantize_int4_ref(qweight, scales, zeros, 32)
    for k in (0, 31, 32, 63):
        for n in range(6):
            want = (float(q[k, n]) - float(zeros[k // 32, n])) * float(scales[k // 32, n])
            assert w[k, n].item() == pytest.approx(want, rel=1e-6)


def test_gemm_ref_reads_x_through_perm():
    _, qweight, scales, zeros = packed_weight(64, 8, 64, seed=2, dtype=torch.float32)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, dtype=torch.float64)
    w = dequantize_int4_ref(qweight, scales, zeros, 64).double()  # layout rows
    dense = torch.empty_like(w)
    dense[perm] = w  # row of input channel perm[k]
    got = int4_gemm_ref(x.float(), qweight, scales, zeros, 64, perm=perm)
    torch.testing.assert_close(got.double(), x @ dense, rtol=1e-5, atol=1e-5)


CASES = [
    # (M, K, N, group, config)
    (1, 256, 96, 64, GemmConfig(1, 32, 64)),
    (3, 128, 64, 128, GemmConfig(4, 32, 32, split_k=2)),
    (1, 256, 80, 32, GemmConfig(1, 16, 32, split_k=4)),
    (5, 256, 96, 64, GemmConfig(16, 32, 64, split_k=2)),
    (16, 128, 64, 32, GemmConfig(16, 64, 32)),
    (40, 256, 48, 256, GemmConfig(32, 16, 64, split_k=3)),
    (20, 512, 32, 128, GemmConfig(16, 32, 128, split_k=4, num_warps=8)),
    # split8: eight products of K / 8 rows, one per nibble (CUDA cores, then tl.dot).
    (1, 256, 96, 64, GemmConfig(1, 32, 64, split8=True)),
    (3, 128, 64, 32, GemmConfig(4, 16, 32, split_k=2, split8=True)),
    (20, 512, 48, 128, GemmConfig(16, 32, 128, split_k=2, split8=True)),
    (40, 256, 32, 256, GemmConfig(32, 16, 128, split8=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k, n, group, config", CASES)
def test_int4_gemm_matches_ref(device, close, m, k, n, group, config, dtype):
    _, qweight, scales, zeros = packed_weight(k, n, group, seed=m + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype)
    args = [t.to(device) for t in (qweight, scales, zeros)]
    got = int4_gemm(x.to(device), *args, group, config)
    assert got.shape == (m, n) and got.dtype == dtype
    close(got, int4_gemm_ref(x.to(device), *args, group), dtype, scale=4)


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(2, 32, 32),
        GemmConfig(16, 32, 64, split_k=2),
        GemmConfig(16, 32, 128, split8=True),
    ],
)
def test_int4_gemm_perm_bias_residual(device, close, config):
    k, n, group = 256, 64, 128
    _, qweight, scales, zeros = packed_weight(k, n, group, seed=5, dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, k, generator=g)
    perm = torch.randperm(k, generator=g)
    bias = torch.randn(n, generator=g)
    residual = torch.randn(7, n, generator=g)
    t = [v.to(device) for v in (x, qweight, scales, zeros, perm, bias, residual)]
    ref = int4_gemm_ref(t[0], *t[1:4], group, perm=t[4], bias=t[5], residual=t[6])
    into = t[6].clone()
    got = int4_gemm(t[0], *t[1:4], group, config, perm=t[4], bias=t[5], residual=into)
    assert got.data_ptr() == into.data_ptr()
    close(got, ref, torch.float32, scale=4)
    # Without the permutation the product differs: the kernel really reads x through perm.
    plain = int4_gemm(t[0], *t[1:4], group, config)
    assert not torch.allclose(plain, int4_gemm_ref(t[0], *t[1:4], group, perm=t[4]), atol=1e-2)


def test_int4_gemm_strided_rows(device, close):
    _, qweight, scales, zeros = packed_weight(64, 32, 32, seed=7, dtype=torch.float32)
    x = torch.randn(4, 100)[:, :64]
    args = [v.to(device) for v in (qweight, scales, zeros)]
    got = int4_gemm(x.to(device), *args, 32, GemmConfig(16, 32, 32))
    close(got, int4_gemm_ref(x.to(device), *args, 32), torch.float32, scale=4)


def test_int4_gemm_rejects_bad_arguments(device):
    _, qweight, scales, zeros = packed_weight(64, 32, 32, dtype=torch.float32)
    qweight, scales, zeros = (v.to(device) for v in (qweight, scales, zeros))
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 16 dividing"):
        int4_gemm(x, qweight, scales, zeros, 32, GemmConfig(16, 32, 64))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        int4_gemm(x[:, :32], qweight, scales, zeros, 32, GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match="scales and zeros must be"):
        int4_gemm(x, qweight, scales[:1], zeros, 32, GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match="qweight must be"):
        int4_gemm(x, qweight.float(), scales, zeros, 32, GemmConfig(16, 32, 32))
    with pytest.raises(ValueError, match="split8 with block_m >= 16 needs block_k >= 128"):
        int4_gemm(x, qweight, scales, zeros, 32, GemmConfig(16, 32, 32, split8=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_perm", [False, True])
def test_dequantize_int4_matches_ref(device, dtype, with_perm):
    k, n, group = 128, 300, 64
    _, qweight, scales, zeros = packed_weight(k, n, group, seed=8)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)) if with_perm else None
    args = [v.to(device) for v in (qweight, scales, zeros)]
    p = perm.to(device) if perm is not None else None
    got = dequantize_int4(*args, group, dtype, perm=p)
    want = dequantize_int4_ordered_ref(*args, group, dtype, perm=p)
    assert got.shape == (k, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# Llama-3.1-8B's projections (N, K) at decode, mixed and prefill row counts, group 128.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA_8B)
@pytest.mark.parametrize(
    "m, config",
    [
        (1, GemmConfig(1, 64, 128, split_k=4)),
        (1, GemmConfig(16, 128, 128, split_k=8, num_stages=4)),
        (16, GemmConfig(16, 64, 128, split_k=4)),
        (256, GemmConfig(64, 128, 64, num_warps=4, num_stages=4)),
        (2048, GemmConfig(128, 256, 64, num_warps=8, num_stages=3)),
        (1, GemmConfig(1, 64, 128, split_k=4, magic=True)),
        (16, GemmConfig(16, 64, 128, split_k=4, magic=True)),
        (2048, GemmConfig(128, 256, 64, num_warps=8, num_stages=3, magic=True)),
        (1, GemmConfig(16, 128, 128, split_k=8, num_stages=4, magic=True, split8=True)),
        (32, GemmConfig(32, 64, 128, split_k=4, split8=True)),
    ],
)
def test_int4_gemm_llama_shapes(close, n, k, m, config):
    _, qweight, scales, zeros = packed_weight(k, n, 128, dtype=torch.bfloat16)
    args = [v.cuda() for v in (qweight, scales, zeros)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = int4_gemm(x, *args, 128, config)
    ref = int4_gemm_ref(x, *args, 128)
    # One bf16 rounding of a sum over K terms: compare relative to the output's scale.
    torch.testing.assert_close(
        got.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.abs().max().item()
    )


@pytest.mark.gpu
def test_dequantize_int4_llama_shape():
    _, qweight, scales, zeros = packed_weight(14336, 4096, 128, dtype=torch.bfloat16)
    args = [v.cuda() for v in (qweight, scales, zeros)]
    perm = torch.randperm(14336, device="cuda")
    got = dequantize_int4(*args, 128, torch.bfloat16, perm=perm)
    torch.testing.assert_close(
        got, dequantize_int4_ordered_ref(*args, 128, torch.bfloat16, perm=perm), rtol=0, atol=0
    )


@pytest.mark.parametrize("config", [GemmConfig(1, 32, 64), GemmConfig(16, 32, 32, split_k=2)])
def test_symmetric_weights_need_no_zeros(device, close, config):
    # zeros None means zero point 8 everywhere: the same product as an explicit tensor of 8s.
    _, qweight, scales, _ = packed_weight(128, 64, 64, seed=9, dtype=torch.float32)
    eights = torch.full_like(scales, 8.0)
    x = torch.randn(3, 128)
    args = [v.to(device) for v in (x, qweight, scales)]
    want = int4_gemm_ref(*args, eights.to(device), 64)
    close(int4_gemm(*args, None, 64, config), want, torch.float32, scale=4)
    close(int4_gemm_ref(*args, None, 64), want, torch.float32)
    got = dequantize_int4(*args[1:], None, 64, torch.float32)
    torch.testing.assert_close(got, dequantize_int4_ref(*args[1:], eights.to(device), 64))


@pytest.mark.parametrize(
    "m, config",
    [
        (1, GemmConfig(1, 32, 64, magic=True)),
        (5, GemmConfig(16, 32, 32, split_k=2, magic=True)),
        (5, GemmConfig(16, 32, 128, magic=True, split8=True)),
    ],
)
@pytest.mark.parametrize("symmetric", [False, True])
def test_magic_weights_match_ref(device, close, m, config, symmetric):
    # Nibbles turned into float16 by their bits (1024 + q), the offset and zero points taken off
    # through x's row sums: the same product (float16 here; bfloat16 in the gpu tests).
    _, qweight, scales, zeros = packed_weight(256, 64, 128, seed=10)
    zeros = None if symmetric else zeros
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(3)).half()
    args = [v.to(device) if v is not None else None for v in (x, qweight, scales, zeros)]
    close(int4_gemm(*args, 128, config), int4_gemm_ref(*args, 128), torch.float16, scale=8)
