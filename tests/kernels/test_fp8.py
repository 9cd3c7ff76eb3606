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


def assert_same_codes(q, q_ref, x, scales) -> None:
    """q, q_ref, x: [M, K]; scales: [M, G] (each over K / G columns). Bytes equal; a failure
    names the first differing element with its input, scale, quotient and both codes."""
    a, b = q.view(torch.uint8), q_ref.view(torch.uint8)
    if torch.equal(a, b):
        return
    m, k = (int(i) for i in (a != b).nonzero()[0])
    s = scales[m, k // -(-x.shape[1] // scales.shape[1])].item()
    value = x[m, k].float().item()
    raise AssertionError(
        f"{int((a != b).sum())} of {a.numel()} codes differ; first at ({m}, {k}): input "
        f"{value!r} / scale {s!r} = {value / s!r}: kernel {int(a[m, k]):#04x}, reference "
        f"{int(b[m, k]):#04x}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_realistic(dtype):
    # The compiled kernels, byte for byte: every code, midpoint, subnormal and saturated value,
    # then activations of a 4096-wide model per token and per 128-group.
    x = _values(1 << 20).to(dtype).cuda()
    for scale in (1.0, 0.37, 3.5e-3):
        s = torch.tensor([scale], device="cuda")
        rows = x.view(1, -1)
        assert_same_codes(quantize_fp8(rows, s), quantize_fp8_ref(rows, s), rows, s.view(1, 1))
    g = torch.Generator().manual_seed(1)
    acts = torch.randn(2048, 4096, generator=g) * torch.rand(2048, 1, generator=g) * 20
    acts[0, :300] = 0  # zero groups
    acts = acts.to(dtype).cuda()
    for group in (None, 128):
        (q, s), (q_ref, s_ref) = (
            quantize_fp8_groups(acts, group),
            quantize_fp8_groups_ref(acts, group),
        )
        differ = s != s_ref
        assert not differ.any(), (
            f"group {group}: {int(differ.sum())} scales differ; first at "
            f"{differ.nonzero()[0].tolist()}: kernel {s[differ][0].item()!r}, reference "
            f"{s_ref[differ][0].item()!r}"
        )
        assert_same_codes(q, q_ref, acts, s)
