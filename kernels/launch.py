"""Guarded Triton import and the argument checks every kernel launcher shares."""

from __future__ import annotations

import functools
import os

import torch


class _MissingTriton:
    """Stands in for `triton` and `triton.language` where Triton is not installed (macOS, CPU).

    Kernel modules must still import there, because they also hold the torch references that the
    CPU path runs: `@triton.jit` and `@triton.jit(...)` leave the function as it is,
    `tl.constexpr` and friends resolve to this object, and anything that would really launch
    raises.
    """

    def __getattr__(self, name: str) -> _MissingTriton:
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        if not args and kwargs:  # @triton.jit(do_not_specialize=...): a decorator factory
            return lambda fn: fn
        raise RuntimeError(
            "Triton is not installed: use the torch reference (batchgen.kernels.ops)"
        )


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    triton = tl = _MissingTriton()
    HAS_TRITON = False

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one without grid dependency control
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "HAS_TRITON",
    "KERNEL_DTYPES",
    "check_caches",
    "check_dtype",
    "check_launchable",
    "check_out",
    "interpreting",
    "num_sms",
    "pdl_prologue",
    "pow2",
    "use_pdl",
    "tl",
    "triton",
]

# Activation / KV dtypes the kernels are built and tested for.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Programmatic dependent launch (Hopper and later): the per-layer kernels of a step that follow
# another kernel on the stream are launched so that the GPU may start them while that kernel
# drains; each waits (griddepcontrol.wait, in pdl_prologue) for it to finish before touching
# memory, so results are the same, and only the launch gap between the two is hidden. 0 turns
# it off.
PDL = 1


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, used by CI)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_out(op: str, q: torch.Tensor, out: torch.Tensor) -> None:
    """Check a caller's output buffer for an attention op: q's shape, dtype and device, and a
    contiguous last dim (the kernels take the two leading strides)."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"{op}: out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: out needs a contiguous last dim, got strides {out.stride()}")


def check_launchable(op: str, *tensors: torch.Tensor) -> None:
    """Check that Triton can run `op` on these tensors: installed, all on one CUDA device, or
    all on the CPU under the interpreter. Cheap on the CUDA path (launchers run every layer)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}: Triton is not installed; call batchgen.kernels.ops.{op}")
    if all(t.is_cuda for t in tensors):
        index = tensors[0].get_device()
        if all(t.get_device() == index for t in tensors):
            return
    elif interpreting() and all(t.device.type == "cpu" for t in tensors):
        return
    devices = sorted({str(t.device) for t in tensors})
    raise ValueError(
        f"{op}: the Triton kernel needs all tensors on one CUDA device (got {', '.join(devices)}); "
        "CPU tensors run only under TRITON_INTERPRET=1, otherwise call batchgen.kernels.ops"
    )


def check_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check that the paged K and V caches are [NB, BS, Hk, D] of one shape."""
    if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape):
        raise ValueError(
            f"{op}: caches must be [NB, BS, Hk, D], "
            f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )


def check_dtype(op: str, name: str, t: torch.Tensor, allowed=KERNEL_DTYPES) -> None:
    """Check that tensor `name` has one of the allowed dtypes."""
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected one of {allowed}")


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 132 (an H100 SXM) for other devices, so the
    interpreter sizes grids as a GPU would. Cached: launchers ask on every step."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def pow2(n: int) -> int:
    """The smallest power of two >= n (and >= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=8)
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch: PDL is on, the device is
    a CUDA GPU of compute capability 9 or later, and Triton has grid dependency control (never
    under the interpreter). Pass it as the kernel's USE_PDL and as `launch_pdl`."""
    return (
        bool(PDL)
        and gdc_wait is not None
        and device.type == "cuda"
        and not interpreting()
        and _has_pdl(device)
    )


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    # First statement of a kernel launched with launch_pdl: wait until the kernel before it on
    # the stream has finished and its writes are visible, then let the next one launch (its
    # programs only take SM room this grid's own have left, since all of ours have started).
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
