"""Fp8Linear: the reference computes each scheme's math (checked against a fake-quantized product
written here), `linear` dispatches FP8 weights to it, and on CUDA the FP8 GEMM paths equal it."""

from __future__ import annotations

import pytest
import torch

from batchgen.layers.fp8_linear import Fp8Linear, Fp8Scheme, fp8_linear, fp8_linear_ref
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


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.activation], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64, 256, 2048])
def test_cuda_paths_equal_reference(scheme, dtype, rows):
    # Llama-3.1-8B's gate_up shape: torch._scaled_mm (bf16, row-wise), the Triton row-wise
    # kernel (fp16) and the block-scaled Triton kernel, against the scheme's fp32 math.
    layer = make_layer(scheme, 28672, 4096, device="cuda", dtype=dtype)
    x = (torch.randn(rows, 4096, device="cuda") * 2).to(dtype)
    y = fp8_linear(x, layer, layer.bias)
    ref = fp8_linear_ref(x, layer, layer.bias)
    assert y.dtype == dtype and y.shape == (rows, 28672)
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)


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
        ref = fp8_linear_ref(x, layer, layer.bias)
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
