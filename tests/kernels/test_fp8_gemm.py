"""fp8_block_gemm / fp8_rowwise_gemm: the FP8 GEMMs against their references (on a GPU within the
FP8 MMA's accumulation bound), and the references against plain matmuls of dequantized operands
written out here."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import quantize_fp8_groups_ref, quantize_fp8_ref
from batchgen.kernels.fp8_gemm import (
    dequantize_blocks_ref,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    fp8_gemm_error_bound,
    fp8_rowwise_gemm,
    fp8_rowwise_gemm_ref,
)

# Relative rounding of the output dtype, generous (one ulp where half of one is the most).
OUT_ROUNDING = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_within_bound(y, ref, x, w, what: str) -> None:
    """|y - ref| <= the MMA's accumulation bound for x [M, K] @ w [N, K]^T (dequantized, fp32)
    plus y's rounding; a failure names the worst element, its values and bound, and how many
    elements are past the bound."""
    accumulation = fp8_gemm_error_bound(x, w)
    bound = accumulation + OUT_ROUNDING[y.dtype] * ref.float().abs() + 1e-6
    err = (y.float() - ref.float()).abs()
    ratio = err / bound
    worst = divmod(int(ratio.argmax()), ratio.shape[1])
    print(f"{what}: max |y - ref| / bound = {ratio.max().item():.3f} at {worst}")
    assert (err <= bound).all(), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements past the bound; worst "
        f"at {worst}: kernel {y[worst].item()!r}, reference {ref[worst].item()!r}, "
        f"|diff| {err[worst].item():.4g}, bound {bound[worst].item():.4g} (accumulation "
        f"{accumulation[worst].item():.4g})"
    )


def _weight(N: int, K: int, block=(128, 128), seed: int = 0):
    """w [N, K] quantized per block: scale = block amax / 448, as block-wise checkpoints store."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)
    nb, kb = -(-N // block[0]), -(-K // block[1])
    scale = torch.empty(nb, kb)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale[i, j] = tile.abs().max() / 448
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                quantize_fp8_ref(tile, scale[i, j])
            )
    return q, scale


def _case(M, N, K, device, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(M, K, generator=g) * 3
    x_q, x_s = quantize_fp8_groups_ref(x, 128)
    w_q, w_s = _weight(N, K, seed=seed)
    b = torch.randn(N, generator=g) if bias else None
    return tuple(t.to(device) if t is not None else None for t in (x_q, x_s, w_q, w_s, b))


@pytest.mark.parametrize("M, N, K", [(1, 128, 128), (5, 256, 384), (33, 130, 200), (17, 64, 300)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_block_gemm_matches_ref(device, close, M, N, K, out_dtype, bias):
    x_q, x_s, w_q, w_s, b = _case(M, N, K, device, bias)
    y = fp8_block_gemm(x_q, x_s, w_q, w_s, out_dtype, bias=b)
    ref = fp8_block_gemm_ref(x_q, x_s, w_q, w_s, out_dtype, bias=b)
    assert y.shape == (M, N) and y.dtype == out_dtype
    close(y, ref, out_dtype, scale=10)  # fp32 sums of up to K products, in another order


def test_ref_is_a_matmul_of_dequantized_operands():
    x_q, x_s, w_q, w_s, b = _case(9, 200, 260, "cpu", bias=True)
    x = x_q.float() * torch.cat([x_s[:, j : j + 1].expand(-1, 128) for j in range(3)], 1)[:, :260]
    rows = torch.cat(
        [w_s[i : i + 1].repeat_interleave(128, 1)[:, :260].expand(128, -1) for i in range(2)]
    )
    w = w_q.float() * rows[:200]
    torch.testing.assert_close(
        fp8_block_gemm_ref(x_q, x_s, w_q, w_s, torch.float32, bias=b), x @ w.t() + b
    )


def test_block_gemm_rejects_bad_args(device):
    x_q, x_s, w_q, w_s, _ = _case(4, 128, 256, device)
    with pytest.raises(ValueError, match=r"x_scale must be \[4, 2\] float32"):
        fp8_block_gemm(x_q, x_s[:, :1].contiguous(), w_q, w_s, torch.float32)
    with pytest.raises(ValueError, match=r"w_scale must be \[1, 2\] float32"):
        fp8_block_gemm(x_q, x_s, w_q, w_s.double(), torch.float32)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_block_gemm(x_q.float(), x_s, w_q, w_s, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64, 256, 2048])
def test_block_gemm_realistic(M):
    # Qwen3 / Llama projection shapes: K = 4096, N = 6144 (fused qkv) and 14336.
    for N in (6144, 14336):
        x_q, x_s, w_q, w_s, _ = _case(M, N, 4096, "cuda")
        y = fp8_block_gemm(x_q, x_s, w_q, w_s, torch.bfloat16)
        ref = fp8_block_gemm_ref(x_q, x_s, w_q, w_s, torch.bfloat16)
        x = dequantize_blocks_ref(x_q, x_s, (1, 128))
        assert_within_bound(y, ref, x, dequantize_blocks_ref(w_q, w_s, (128, 128)), f"N={N}")


def _rowwise_case(M, N, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_q, x_s = quantize_fp8_groups_ref(torch.randn(M, K, generator=g) * 5)
    w = torch.randn(N, K, generator=g)
    w_s = w.abs().amax(dim=1) / 448
    w_q = quantize_fp8_ref(w, w_s[:, None])
    return tuple(t.to(device) for t in (x_q, x_s, w_q, w_s))


@pytest.mark.parametrize("M, N, K", [(1, 32, 64), (19, 176, 64), (8, 64, 300)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_rowwise_gemm_matches_ref(device, close, M, N, K, out_dtype):
    x_q, x_s, w_q, w_s = _rowwise_case(M, N, K, device)
    bias = torch.randn(N, device=device)
    y = fp8_rowwise_gemm(x_q, x_s, w_q, w_s, out_dtype, bias)
    close(y, fp8_rowwise_gemm_ref(x_q, x_s, w_q, w_s, out_dtype, bias), out_dtype, scale=10)
    x = x_q.float().cpu() * x_s.cpu()  # the reference, written out: dequantize, then multiply
    w = w_q.float().cpu() * w_s.cpu()[:, None]
    torch.testing.assert_close(
        fp8_rowwise_gemm_ref(x_q, x_s, w_q, w_s, torch.float32).cpu(), x @ w.t()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 256, 2048])
def test_rowwise_gemm_realistic(M):
    x_q, x_s, w_q, w_s = _rowwise_case(M, 14336, 4096, "cuda")
    y = fp8_rowwise_gemm(x_q, x_s, w_q, w_s, torch.float16)
    ref = fp8_rowwise_gemm_ref(x_q, x_s, w_q, w_s, torch.float16)
    assert_within_bound(y, ref, x_q.float() * x_s, w_q.float() * w_s[:, None], f"M={M}")
