"""Int4Linear: a projection whose weight is 4-bit (W4A16: activations stay 16-bit), held in the one
packed layout of batchgen.kernels.int4_gemm that every checkpoint format is converted into.

On CUDA, rows up to the tuned crossover run the fused dequantize-in-the-GEMM kernel; larger
steps may instead dequantize the weight to a 16-bit scratch matrix and run cuBLAS
(batchgen.layers.int4_tuning picks per row count and shape). Elsewhere the reference
dequantizes in fp32 and multiplies (the CPU path, exact to the format's definition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.kernels import ops
from batchgen.kernels.int4_dequant import dequantize_int4
from batchgen.kernels.int4_gemm import PACK, check_layout, int4_gemm, int4_gemm_ref
from batchgen.layers import int4_tuning

SYMMETRIC_ZERO = 8  # the zero point of symmetric 4-bit weights (values -8 .. 7 stored + 8)


@dataclass
class PackedInt4:
    """A 4-bit weight of `out` x `in` in the packed layout (kernels/int4_gemm.py).

    qweight [in / 8, out] int32; scales, zeros [in / group_size, out] (one float dtype; zeros
    None when every zero point is 8, symmetric weights); perm [in] int64 or None (act order: the
    layout's column k is input channel perm[k]).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None = None

    @classmethod
    def of(cls, qweight, scales, zeros, group_size: int, perm=None) -> PackedInt4:
        """A PackedInt4 whose zeros are dropped (None) when all of them are 8."""
        if zeros is not None and bool((zeros == SYMMETRIC_ZERO).all()):
            zeros = None
        return cls(qweight, scales, zeros, group_size, perm)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def check(self, where: str) -> None:
        """Raise ValueError naming `where` unless the tensors fit together."""
        check_layout(where, self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> PackedInt4:
        """On `device`, scales and zeros in `dtype` when given (the packed ints unchanged)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device, dtype) if dtype is not None else t.to(device)

        return PackedInt4(
            self.qweight.to(device),
            move(self.scales),
            move(self.zeros),
            self.group_size,
            self.perm.to(device) if self.perm is not None else None,
        )


def concat_outputs(parts: list[PackedInt4], where: str) -> PackedInt4:
    """Fuse projections of one input (q/k/v, gate/up) along the output dim: their columns,
    scales and zeros side by side. They must share group size and input order (perm)."""
    first = parts[0]
    for p in parts[1:]:
        if p.group_size != first.group_size or p.in_features != first.in_features:
            raise ValueError(
                f"{where}: fused projections need one group size and input size, got "
                f"{[q.group_size for q in parts]} and {[q.in_features for q in parts]}"
            )
        same = (p.perm is None) == (first.perm is None) and (
            p.perm is None or torch.equal(p.perm, first.perm)
        )
        if not same:
            raise ValueError(
                f"{where}: fused projections have different act orders (g_idx), so they "
                "cannot read one input; batchgen fuses q/k/v and gate/up"
            )
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else _eights(p) for p in parts], dim=1)
    return PackedInt4(
        torch.cat([p.qweight for p in parts], dim=1),
        torch.cat([p.scales for p in parts], dim=1),
        zeros,
        first.group_size,
        first.perm,
    )


def _eights(p: PackedInt4) -> torch.Tensor:
    return torch.full_like(p.scales, SYMMETRIC_ZERO)


class Int4Linear(nn.Module):
    """y = x @ W^T + bias, W 4-bit.

    Buffers: `weight` (the packed qweight [in / 8, out] int32: batchgen.layers.linear runs
    products by weight tensor and finds this layer through `weight.int4_layer`), `scales`,
    `zeros`, `perm`; filled by `set_packed`. `bias` is a parameter in the activations' dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = in_features
        empty = torch.empty(0, dtype=torch.int32, device=device)
        self.register_buffer("weight", empty)
        self.register_buffer("scales", torch.empty(0, device=device))
        self.register_buffer("zeros", None)
        self.register_buffer("perm", None)
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def set_packed(self, packed: PackedInt4) -> None:
        """Take the packed weight (its tensors, as they are)."""
        where = f"Int4Linear({self.in_features} -> {self.out_features})"
        packed.check(where)
        if (packed.in_features, packed.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"{where}: packed weight is {packed.in_features} -> {packed.out_features}"
            )
        self.weight = packed.qweight.contiguous()
        self.scales = packed.scales.contiguous()
        self.zeros = packed.zeros.contiguous() if packed.zeros is not None else None
        self.perm = packed.perm
        self.group_size = packed.group_size
        self.weight.int4_layer = self
        int4_tuning.register(self)

    def packed(self) -> PackedInt4:
        return PackedInt4(self.weight, self.scales, self.zeros, self.group_size, self.perm)

    def packed_bytes(self) -> int:
        """Bytes a product reads of the weight: packed ints, scales, zeros and perm."""
        tensors = (self.weight, self.scales, self.zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self, self.bias)

    def extra_repr(self) -> str:
        order = ", act order" if self.perm is not None else ""
        sym = ", symmetric" if self.zeros is None else ""
        return (
            f"in={self.in_features}, out={self.out_features}, group={self.group_size}{order}{sym}, "
            f"bias={self.bias is not None}"
        )


def weight_count(model: nn.Module) -> int:
    """The model's parameters, a 4-bit layer counting its in x out weights (its packed weight
    is a buffer, not a parameter)."""
    packed = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, Int4Linear)
    )
    return packed + sum(p.numel() for p in model.parameters())


def int4_linear(
    x: torch.Tensor,
    layer: Int4Linear,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """layer's product for x [..., K] (+ bias); residual [M, N] += it in place, or out [M, N]
    = it (either is then returned).

    CUDA: the tuned path for the row count (fused kernel, or dequantize + cuBLAS); elsewhere
    the fp32 reference, rounded once to x's dtype.
    """
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    p = layer.packed()
    into = residual if residual is not None else out
    if not ops.use_triton(x2):
        y = int4_gemm_ref(x2, p.qweight, p.scales, p.zeros, p.group_size, p.perm, bias, residual)
        return into.copy_(y) if into is not None else y.view(*lead, y.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    choice = int4_tuning.choose(x2.shape[0], layer, x2.dtype)
    if choice is int4_tuning.DEQUANT:
        y = dense_product(x2, p, bias, residual, out)
    else:
        y = int4_gemm(x2, p.qweight, p.scales, p.zeros, p.group_size, choice, p.perm, bias,
                      residual, out)  # fmt: skip
    return y if into is not None else y.view(*lead, y.shape[-1])


def dense_product(
    x: torch.Tensor,
    p: PackedInt4,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill path: W dequantized to x's dtype ([K, N] scratch in input-channel order,
    freed after the product), then one cuBLAS GEMM (into residual, or out, when given)."""
    w = dequantize_int4(p.qweight, p.scales, p.zeros, p.group_size, x.dtype, p.perm)  # [K, N]
    if residual is not None:
        residual.addmm_(x, w)
        return residual if bias is None else residual.add_(bias)
    if bias is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(bias, x, w, out=out)
