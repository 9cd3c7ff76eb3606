"""Fixtures of the kernel tests: the device launchers run on, tolerances, and GPU gating.

Small-shape tests run the Triton launchers on CPU tensors under TRITON_INTERPRET=1 (CI), or on
CUDA tensors when a GPU is present. The interpreter runs bf16 tl.dot on raw bits and truncates
fp32 -> bf16 casts, so there bf16 is left to the attention kernels' GPU runs, and the bf16
tolerance below (about 2-3 ulp) also covers the truncation in the element-wise kernels. Tests
marked `gpu` run at realistic shapes only on CUDA without the interpreter and are skipped
elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from batchgen.kernels.launch import HAS_TRITON

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU = torch.cuda.is_available() and not INTERPRET

# (atol, rtol) of a kernel against its reference, per dtype.
_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture(autouse=True)
def _gpu_gate(request):
    if request.node.get_closest_marker("gpu") and not GPU:
        pytest.skip("needs a CUDA device (and TRITON_INTERPRET unset)")


@pytest.fixture
def device() -> str:
    """Where the Triton launchers run: CPU under the interpreter, else CUDA, else skip."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if INTERPRET:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def close():
    """assert_close(actual, expected) at the tolerance of `dtype`, times `scale`."""

    def check(actual, expected, dtype, scale: float = 1.0):
        atol, rtol = _TOL[dtype]
        torch.testing.assert_close(
            actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale
        )

    return check
