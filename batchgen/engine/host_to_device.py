"""Host lists to device tensors without a stream sync (async scheduling depends on it).

`torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the
stream, which would stall the host until the step in flight finishes. Staging through pinned
memory makes the copy asynchronous; the caching host allocator keeps the pinned block alive
until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (list or numpy array) -> tensor of dtype on device, asynchronously on CUDA."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
