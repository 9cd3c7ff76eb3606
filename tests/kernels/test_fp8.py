"""FP8 e4m3 quantization: the kernels' rounding equals torch's cast bit for bit, every code."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_fp8,
    quantize_fp8_groups,
    quantize_fp8_groups_ref,
    quantize_fp8_ref,
)


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    every_code = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    every_code = every_code[~every_code.isnan()]
    midpoints = (every_code.sort().values[1:] + every_code.sort().values[:-1]) / 2  # ties
    return torch.cat(
        [
            every_code,
            midpoints,
            torch.randn(n, generator=g) * 30,
            torch.randn(n, generator=g) * 1e-3,  # subnormals
            torch.linspace(-2 * FP8_MAX, 2 * FP8_MAX, 999),  # saturation
            torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30]),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.5e-3])
def test_quantize_equals_torch_cast(device, dtype, scale):
    x = _values(4096).to(dtype).to(device)
    s = torch.tensor([scale], device=device)
    got = quantize_fp8(x, s)
    ref = quantize_fp8_ref(x, s)
    assert got.dtype == FP8_DTYPE and got.shape == x.shape
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_reference_saturates_and_rounds_to_nearest():
    x = torch.tensor([500.0, -1000.0, 125.4, 124.0, 0.0009765625 * 1.5])
    q = quantize_fp8_ref(x, 1.0).float()
    # 124 is the tie between 120 and 128: even mantissa (128). 1.5 * 2^-10 rounds to 2^-9.
    assert q.tolist() == [448.0, -448.0, 128.0, 128.0, 2.0**-9]


def test_quantize_rejects_bad_scale(device):
    x = torch.ones(4, device=device)
    with pytest.raises(ValueError, match="scale must be 1 contiguous float32"):
        quantize_fp8(x, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="scale must be 1 contiguous float32"):
        quantize_fp8(x, torch.ones(1, dtype=torch.float64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M, K, group", [(1, 64, None), (7, 300, None), (5, 256, 128), (3, 200, 128), (4, 2500, None)]
)
def test_quantize_groups_equals_ref(device, dtype, M, K, group):
    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 20).to(dtype).to(device)
    x[0, : min(K, 130)] = 0  # a zero group (and a zero row when K <= 130)
    q, s = quantize_fp8_groups(x, group)
    q_ref, s_ref = quantize_fp8_groups_ref(x, group)
    num_groups = 1 if group is None else -(-K // group)
    assert q.shape == (M, K) and s.shape == (M, num_groups) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_groups_ref_by_hand():
    x = torch.tensor([[1.0, -2.0, 448.0, 0.5], [0.0, 0.0, 3.0, -6.0]])
    q, s = quantize_fp8_groups_ref(x, 2)
    # Groups of 2: amax 2 / 448, 448 / 448; 0 -> MIN_AMAX / 448, 6 / 448.
    assert s.flatten().tolist() == pytest.approx([2 / 448, 1.0, 1e-12 / 448, 6 / 448])
    deq = q.float() * s.repeat_interleave(2, dim=1)
    assert deq[0].tolist() == pytest.approx([1.0, -2.0, 448.0, 0.5], rel=2**-4)
    assert deq[1, 3].item() == pytest.approx(-6.0) and deq[1, :2].tolist() == [0.0, 0.0]
    q_row, s_row = quantize_fp8_groups_ref(x)  # per token: one scale a row
    assert s_row.flatten().tolist() == pytest.approx([1.0, 6 / 448])
