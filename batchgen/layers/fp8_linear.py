"""Fp8Linear: a projection whose weight is FP8 e4m3 with per-output-channel or 2-D block scales,
its input quantized to e4m3 as the scheme says (per token, per static tensor scale, per 1 x 128
group, or not at all). On CUDA the product runs on FP8 tensor cores (torch._scaled_mm with
row-wise scales, kernels.fp8_gemm for blocks); elsewhere `fp8_linear_ref` computes the scheme's
exact math in fp32 (dequantized weights, activations quantized and dequantized), the reference
every path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.kernels.fp8 import (
    FP8_DTYPE,
    quantize_fp8,
    quantize_fp8_groups,
    quantize_fp8_ref,
)
from batchgen.kernels.fp8_gemm import (
    dequantize_blocks_ref,
    fake_quantize_groups_ref,
    fp8_block_gemm,
    fp8_rowwise_gemm,
)

WEIGHT_STRATEGIES = ("channel", "block")
ACTIVATION_STRATEGIES = (None, "token", "tensor", "group")
# torch._scaled_mm's use_fast_accum: off keeps cuBLAS's periodic promotion of the FP8 MMA's
# partial sums to fp32 (exact enough for K in the thousands).
FAST_ACCUM = False


@dataclass(frozen=True)
class Fp8Scheme:
    """How a projection is quantized.

    weight: "channel" (one scale per output row; a per-tensor checkpoint scale is expanded to
        every row, exactly) or "block" (one scale per block x block_k weight tile).
    activation: None (weight only: the input stays in the activations' dtype), "token" (dynamic:
        scale = max |x| of the row / 448), "tensor" (static: the checkpoint's input_scale) or
        "group" (dynamic, one scale per 1 x block_k group of a row; with block weights).
    block: (block_n, block_k) of "block" weights.
    """

    weight: str
    activation: str | None
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_STRATEGIES or self.activation not in ACTIVATION_STRATEGIES:
            raise ValueError(f"unsupported FP8 scheme {self}")
        if (self.weight == "block") != (self.block is not None):
            raise ValueError(f"{self}: block weights need a block size, and only they take one")
        if (self.activation == "group" and self.weight != "block") or (
            self.weight == "block" and self.activation not in (None, "group")
        ):
            raise ValueError(f"{self}: block weights take group activations (or none), only they")

    @property
    def input_group(self) -> int | None:
        """Columns of an input row one dynamic scale covers: block_k for "group" activations,
        None (the whole row) for "token"."""
        return self.block[1] if self.activation == "group" else None


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight)^T + bias for x [..., in_features].

    weight: [out, in] float8_e4m3fn, a parameter (the loader fills it, fused shards included);
    weight_scale: float32 buffer, [out] (channel) or [ceil(out / bn), ceil(in / bk)] (block),
    dequantizing: w = float(weight) * scale; input_scale: [1] float32 buffer of static
    activation schemes; bias: in `dtype`, the activations'.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: Fp8Scheme,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.act_dtype = dtype or torch.get_default_dtype()  # the activations' (and bias') dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        if scheme.weight == "block":
            bn, bk = scheme.block
            shape = (-(-out_features // bn), -(-in_features // bk))
        else:
            shape = (out_features,)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        if scheme.activation == "tensor":
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_scale = None
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        # batchgen.layers.linear runs products by weight tensor: it finds this layer through it.
        self.weight.fp8_layer = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


def fp8_linear(x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """layer's product for x [..., K], plus `bias` when given (callers pass the layer's bias or
    add it later themselves); FP8 tensor cores on CUDA, fp8_linear_ref elsewhere."""
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if not x.is_cuda or layer.scheme.activation is None:
        y = fp8_linear_ref(x2, layer, bias)
    elif layer.scheme.weight == "block":
        x_q, x_s = quantize_fp8_groups(x2.contiguous(), layer.scheme.block[1])
        y = fp8_block_gemm(
            x_q, x_s, layer.weight, layer.weight_scale, x.dtype, layer.scheme.block, bias
        )
    else:
        y = _scaled_mm(x2.contiguous(), layer, bias)
    return y.view(*lead, y.shape[-1])


def _scaled_mm(x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-channel weights: x quantized per token (or with the static scale), one FP8 GEMM with
    row-wise scales ([M, 1] for x, [N] for the weight): cuBLASLt's (torch._scaled_mm) for bf16
    activations, which is all its row-wise FP8 takes, the Triton kernel for fp16 / fp32."""
    if layer.scheme.activation == "token":
        x_q, x_s = quantize_fp8_groups(x)  # [M, K] e4m3, [M, 1]
    else:
        x_q = quantize_fp8(x, layer.input_scale)
        x_s = layer.input_scale.expand(x.shape[0], 1).contiguous()
    if x.dtype != torch.bfloat16:
        return fp8_rowwise_gemm(x_q, x_s, layer.weight, layer.weight_scale, x.dtype, bias)
    y = torch._scaled_mm(
        x_q,
        layer.weight.t(),  # [K, N], column-major: the TN layout FP8 GEMMs need on Hopper
        scale_a=x_s,
        scale_b=layer.weight_scale.view(1, -1),
        out_dtype=x.dtype,
        use_fast_accum=FAST_ACCUM,
    )
    return y if bias is None else y.add_(bias)


def dequantized_weight(layer: Fp8Linear) -> torch.Tensor:
    """The weight as the scheme defines it, float(weight) * scale, in fp32 [out, in]."""
    if layer.scheme.weight == "block":
        return dequantize_blocks_ref(layer.weight, layer.weight_scale, layer.scheme.block)
    return layer.weight.float() * layer.weight_scale[:, None]


def quantize_input_ref(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """x [M, K] as the scheme feeds it to the GEMM, dequantized back to fp32."""
    act = layer.scheme.activation
    if act is None:
        return x.float()
    if act == "tensor":
        return quantize_fp8_ref(x, layer.input_scale).float() * layer.input_scale
    return fake_quantize_groups_ref(x, layer.scheme.input_group)


def fp8_linear_ref(
    x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The scheme's math in fp32 for x [M, K]: quantize_input_ref(x) @ dequantized_weight^T
    (+ bias), rounded once to x's dtype."""
    y = quantize_input_ref(x, layer) @ dequantized_weight(layer).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
