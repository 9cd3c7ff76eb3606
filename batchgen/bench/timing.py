"""Synchronized wall-clock timing: the GPU is drained before the clock starts and stops."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """(seconds, fn()) with the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def median_index(values: list[float]) -> int:
    """Index of the run whose value is the (lower) median, so its other numbers go with it."""
    target = statistics.median_low(values)
    return values.index(target)


def peak_memory_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
