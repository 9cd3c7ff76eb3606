"""FP8 e4m3 quantization: the kernels' rounding equals torch's cast bit for bit, every code."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8, quantize_fp8_ref


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
