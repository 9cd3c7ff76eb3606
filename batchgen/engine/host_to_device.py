"""Host lists to device tensors, and device results back to the host, without stream syncs.

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the
stream, which would stall the host until the step in flight finishes. Staging through pinned
memory makes copies asynchronous, but allocating pinned memory (cudaHostAlloc) is itself
implicitly synchronizing, and batch shapes change every step while prompts are admitted. So
the runner stages through a PinnedStager: pinned buffers allocated once, grown rarely, and
reused in turn.
"""

from __future__ import annotations

import array

import torch

# array.array type codes of the integer dtypes a step's inputs use (C int is 32 bits here).
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}
assert array.array("i").itemsize == 4 and array.array("q").itemsize == 8


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """values (flat list, nested list or numpy array) -> CPU tensor of dtype. A flat list of
    ints goes through array.array: for a 16k-token prompt chunk that is about 4x faster than
    torch.as_tensor, which converts element by element (three such lists a mixed step)."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and isinstance(values, list) and values and type(values[0]) is int:
        return torch.frombuffer(array.array(code, values), dtype=dtype)
    return torch.as_tensor(values, dtype=dtype)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (list or numpy array) -> tensor of dtype on device; for code outside a runner
    step (tests, start-up), staged through freshly pinned memory on CUDA."""
    t = host_tensor(values, dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class PinnedStager:
    """Pinned host buffers for one engine's steps, in two sets used by alternate steps.

    Step N stages its inputs (and reads its results back) through set N % 2. The engine has
    waited for step N (its copies included) before it launches step N + 2, the next user of
    that set, so no buffer is overwritten while a copy from it may still be pending.

    Args:
        device: the runner's device; on CPU, values become CPU tensors and nothing is staged.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: list[list[torch.Tensor]] = [[], []]  # per set: uint8 pinned buffers
        self._turn = 0
        self._next = 0

    @property
    def turn(self) -> int:
        """The buffer set of the step in progress (0 or 1; alternates with each step)."""
        return self._turn

    def begin_step(self) -> None:
        """Switch to the other buffer set; call once at the start of each launched step."""
        self._turn ^= 1
        self._next = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buffers = self._sets[self._turn]
        if self._next == len(buffers):
            buffers.append(torch.empty(0, dtype=torch.uint8))
        if buffers[self._next].numel() < nbytes:
            size = max(4096, 1 << (nbytes - 1).bit_length())  # grow by powers of two: rarely
            buffers[self._next] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buf = buffers[self._next]
        self._next += 1
        return buf[:nbytes]

    def to_device(self, values, dtype: torch.dtype, device: torch.device | None = None):
        """values (list, nested list or numpy array) -> tensor of dtype on the device."""
        t = host_tensor(values, dtype)
        if self.device.type != "cuda":
            return t
        staged = self._buffer(t.numel() * t.element_size()).view(dtype).view(t.shape)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for this step to fill and copy to the device (pinned on CUDA, from the
        step's buffer set; a plain CPU tensor on the CPU). Contents are stale: overwrite it."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if self.device.type != "cuda":
            return torch.empty(shape, dtype=dtype)
        return self._buffer(nbytes).view(dtype).view(shape)

    def to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Start copying a device tensor into a pinned buffer; read it after the step's event."""
        if t is None or not t.is_cuda:
            return t
        host = self._buffer(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host
