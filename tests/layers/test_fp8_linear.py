"""Fp8Linear: the reference computes each scheme's math (checked against a fake-quantized product
written here), `linear` dispatches FP8 weights to it, and on CUDA the FP8 GEMM paths equal it."""

from __future__ import annotations

import pytest
import torch
from batchgen.kernels.fp8 import (
    quantize_fp8,
    quantize_fp8_groups,
    quantize_fp8_groups_ref,
    quantize_fp8_ref,
)
from batchgen.kernels.fp8_gemm import fp8_gemm_error_bound

from batchgen.layers.fp8_linear import (
    Fp8Linear,
    Fp8Scheme,
    dequantized_weight,
    fp8_linear,
    fp8_linear_ref,
    quantize_input_ref,
)
from batchgen.layers.linear import add_linear_, linear

E4M3 = torch.float8_e4m3fn
SCHEMES = [
    Fp8Scheme("channel", None),
    Fp8Scheme("channel", "token"),
    Fp8Scheme("channel", "tensor"),
    Fp8Scheme("block", None, (128, 128)),
    Fp8Scheme("block", "group", (128, 128)),
]


def make_layer(scheme: Fp8Scheme, n: int, k: int, device="cpu", bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(n + k)
    layer = Fp8Linear(k, n, bias, scheme, device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g) / k**0.5
    with torch.no_grad():
        if scheme.weight == "block":
            bn, bk = scheme.block
            s = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 1e-3
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        else:
            s = w.abs().amax(dim=1) / 448
            full = s[:, None]
        layer.weight.copy_((w / full).clamp(-448, 448).to(E4M3).to(device))
        layer.weight_scale.copy_(s)
        if layer.input_scale is not None:
            layer.input_scale.fill_(0.02)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer


def fake_quant_product(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """The scheme written out: weight tile by tile times its scale; x rounded to e4m3 with its
    scale (row max / 448, per 128 columns for groups, or the static one) and scaled back."""
    n, k = layer.weight.shape
    w = layer.weight.float().cpu()
    s = layer.weight_scale.cpu()
    if layer.scheme.weight == "block":
        for i in range(0, n, 128):
            for j in range(0, k, 128):
                w[i : i + 128, j : j + 128] *= s[i // 128, j // 128]
    else:
        w = w * s[:, None]
    x = x.float().cpu()
    act = layer.scheme.activation
    if act == "tensor":
        x = (x / 0.02).clamp(-448, 448).to(E4M3).float() * 0.02
    elif act is not None:
        width = 128 if act == "group" else k
        cols = []
        for chunk in x.split(width, dim=1):
            sc = chunk.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
            cols.append((chunk / sc).clamp(-448, 448).to(E4M3).float() * sc)
        x = torch.cat(cols, 1)
    return x @ w.t() + layer.bias.float().cpu()


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_reference_is_the_scheme(scheme):
    layer = make_layer(scheme, 256, 384)
    x = torch.randn(9, 384) * 3
    x[2] = 0  # a zero row: scale MIN_AMAX / 448, zeros out
    torch.testing.assert_close(fp8_linear_ref(x, layer, layer.bias), fake_quant_product(x, layer))
    y = layer(x.view(3, 3, 384))  # leading dims kept
    assert y.shape == (3, 3, 256)
    torch.testing.assert_close(y.view(9, 256), fake_quant_product(x, layer))


def test_linear_dispatches_fp8_weights():
    layer = make_layer(Fp8Scheme("channel", "token"), 64, 128)
    x = torch.randn(5, 128)
    with_bias = fake_quant_product(x, layer)
    torch.testing.assert_close(linear(x, layer.weight, layer.bias), with_bias)
    # Without a bias argument nothing is added (tensor parallel adds it after the reduction).
    torch.testing.assert_close(linear(x, layer.weight), with_bias - layer.bias)
    residual = torch.ones(5, 64)
    out = add_linear_(residual, x, layer.weight)
    assert out is residual
    torch.testing.assert_close(residual, 1 + with_bias - layer.bias)


def test_scheme_checks():
    with pytest.raises(ValueError, match="block weights need a block size"):
        Fp8Scheme("block", "group")
    with pytest.raises(ValueError, match="block weights take group activations"):
        Fp8Scheme("block", "token", (128, 128))
    with pytest.raises(ValueError, match="unsupported FP8 scheme"):
        Fp8Scheme("tensor", "token")


# Relative rounding of the output dtype, generous (one ulp where half of one is the most).
OUT_ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def check_input_quantization(x: torch.Tensor, layer: Fp8Linear) -> None:
    """The CUDA path's quantize kernel gives the reference's scales and bytes exactly; a failure
    names the first differing element with its input and both scales."""
    act = layer.scheme.activation
    if act == "tensor":
        q, q_ref = quantize_fp8(x, layer.input_scale), quantize_fp8_ref(x, layer.input_scale)
        s = s_ref = layer.input_scale.expand(x.shape[0], 1)
    else:
        group = layer.scheme.block[1] if act == "group" else None
        (q, s), (q_ref, s_ref) = quantize_fp8_groups(x, group), quantize_fp8_groups_ref(x, group)
    s_ref = s_ref.to(s.device)
    assert torch.equal(s, s_ref), (
        f"{int((s != s_ref).sum())} scales differ; first at "
        f"{[int(i) for i in (s != s_ref).nonzero()[0]]}: kernel {s[s != s_ref][0].item()!r}, "
        f"reference {s_ref[s != s_ref][0].item()!r}"
    )
    a, b = q.view(torch.uint8), q_ref.view(torch.uint8)
    if not torch.equal(a, b):
        m, k = (int(i) for i in (a != b).nonzero()[0])
        g = k // (x.shape[1] // s.shape[1]) if s.shape[1] > 1 else 0
        raise AssertionError(
            f"{int((a != b).sum())} of {a.numel()} codes differ; first at ({m}, {k}): input "
            f"{x[m, k].item()!r} / scale {s[m, g].item()!r}: kernel {int(a[m, k]):#04x}, "
            f"reference {int(b[m, k]):#04x}"
        )


def assert_within_bound(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, layer) -> None:
    """|y - ref| <= the FP8 MMA's accumulation bound (kernels.fp8_gemm) plus the rounding of y
    and, for the cuBLASLt path that adds the bias after rounding, of y without it."""
    ref = ref.float()
    unbiased = ref - layer.bias.float() if layer.bias is not None else ref
    bound = fp8_gemm_error_bound(quantize_input_ref(x, layer), dequantized_weight(layer))
    bound += OUT_ROUNDING[y.dtype] * (ref.abs() + unbiased.abs()) + 1e-6
    err = (y.float() - ref).abs()
    m, n = divmod(int((err / bound).argmax()), err.shape[1])
    assert (err <= bound).all(), (
        f"{int((err > bound).sum())} of {err.numel()} elements past the bound; worst at "
        f"({m}, {n}): y {y[m, n].item()!r}, reference {ref[m, n].item()!r}, |diff| "
        f"{err[m, n].item():.4g}, bound {bound[m, n].item():.4g}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.activation], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64, 256, 2048])
def test_cuda_paths_equal_reference(scheme, dtype, rows):
    # Llama-3.1-8B's gate_up shape: torch._scaled_mm (bf16, row-wise), the Triton row-wise
    # kernel (fp16) and the block-scaled Triton kernel, against the scheme's fp32 math: the
    # input quantized exactly as the reference does, the product within the FP8 MMA's bound.
    layer = make_layer(scheme, 28672, 4096, device="cuda", dtype=dtype)
    x = (torch.randn(rows, 4096, device="cuda") * 2).to(dtype)
    check_input_quantization(x, layer)
    y = fp8_linear(x, layer, layer.bias)
    ref = fp8_linear_ref(x, layer, layer.bias)
    assert y.dtype == dtype and y.shape == (rows, 28672)
    assert_within_bound(y, ref, x, layer)


@pytest.mark.gpu
def test_cuda_graph_replay():
    layer = make_layer(
        Fp8Scheme("channel", "token"), 4096, 4096, device="cuda", dtype=torch.bfloat16
    )
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, layer, layer.bias)  # compile / pick kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, layer, layer.bias)
    for _ in range(2):
        x.normal_()
        graph.replay()
        assert_within_bound(y, fp8_linear_ref(x, layer, layer.bias), x, layer)
