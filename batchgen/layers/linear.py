"""The models' projections: y = x @ W^T (`linear`; `linear_out_` into a given tensor) and
residual += x @ W^T (`add_linear_`), through a cuBLASLt algorithm registered for the exact shape
(batchgen.layers.gemm_tuning registers the ones that beat cuBLAS), else through torch (F.linear /
addmm / mm: cuBLAS's own pick; always on CPU). An FP8 weight (batchgen.layers.fp8_linear) runs
its layer's FP8 product instead, a 4-bit one (its packed int32 tensor,
batchgen.layers.int4_linear) its layer's 4-bit product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.fp8 import FP8_DTYPE
from batchgen.layers.fp8_linear import fp8_linear
from batchgen.layers.int4_linear import int4_linear

# (rows, N, K, weight K-major, accumulate, x row stride, dtype, device index) -> (product, algo)
_TUNED: dict[tuple, tuple] = {}


def weight_kn(weight: torch.Tensor) -> bool | None:
    """True if weight [N, K] is stored K-major, False if row-major, None if neither."""
    n, k = weight.shape
    if weight.stride() == (k, 1):
        return False
    if weight.stride() == (1, n):
        return True
    return None


def _key(rows: int, x_ld: int, weight: torch.Tensor, accumulate: bool) -> tuple:
    n, k = weight.shape
    return (rows, n, k, weight_kn(weight), accumulate, x_ld, weight.dtype, weight.device.index)


def register(rows: int, weight: torch.Tensor, accumulate: bool, product, algo) -> None:
    """Run products of `rows` contiguous rows with weight's shape, layout, dtype and device
    (and accumulate) through product (a kernels.cublaslt.LtProduct) with algo."""
    _TUNED[_key(rows, weight.shape[1], weight, accumulate)] = (product, algo)


def clear_tuning() -> None:
    """Forget every registered shape (torch runs all projections again)."""
    _TUNED.clear()


def _tuned(x: torch.Tensor, weight: torch.Tensor, accumulate: bool):
    if not _TUNED or not x.is_cuda or x.dim() != 2 or x.stride(1) != 1 or x.dtype != weight.dtype:
        return None
    return _TUNED.get(_key(x.shape[0], x.stride(0), weight, accumulate))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    if weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight.fp8_layer, bias)
    if weight.dtype == torch.int32:
        return int4_linear(x, weight.int4_layer, bias)
    entry = _tuned(x, weight, False) if bias is None else None
    if entry is None:
        return F.linear(x, weight, bias)
    product, algo = entry
    return product(x, weight, algo)


def add_linear_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """residual [M, N] += x [M, K] @ weight [N, K]^T in place (the GEMM's beta = 1); returns
    residual."""
    if weight.dtype == FP8_DTYPE:
        return residual.add_(fp8_linear(x, weight.fp8_layer))
    if weight.dtype == torch.int32:
        return int4_linear(x, weight.int4_layer, residual=residual)
    ok = residual.is_contiguous() and residual.dtype == x.dtype
    entry = _tuned(x, weight, True) if ok else None
    if entry is None:
        return residual.addmm_(x, weight.t())
    product, algo = entry
    return product(x, weight, algo, out=residual)


def linear_out_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] @ weight [N, K]^T, written into out (the GEMM's beta = 0: out's
    old values are never read); returns out."""
    if weight.dtype == FP8_DTYPE:
        return out.copy_(fp8_linear(x, weight.fp8_layer))
    if weight.dtype == torch.int32:
        return int4_linear(x, weight.int4_layer, out=out)
    ok = out.is_contiguous() and out.dtype == x.dtype
    entry = _tuned(x, weight, False) if ok else None
    if entry is None:
        return torch.mm(x, weight.t(), out=out)
    product, algo = entry
    return product(x, weight, algo, out=out)
