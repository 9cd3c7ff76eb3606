"""Timing: synchronized wall clock (the GPU is drained before the clock starts and stops), and
CUDA-graph replays timed by CUDA events (GPU time without Python's per-call launch cost)."""

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


def capture_graph(fn: Callable[[], object], keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph. fn runs once first on a side stream, so kernels compile and
    libraries set up their per-stream workspaces outside the capture. keep_graph: keep the
    captured cudaGraph_t (`raw_cuda_graph()`) so its nodes can be read or edited; call
    `instantiate()` (or replay) after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_median_us(fn: Callable[[], object], reps: int, before=None) -> float:
    """Median microseconds of a CUDA-graph replay of fn over reps timed replays (the upper median
    when reps is even). fn is captured (capture_graph) and replayed once untimed; `before` (e.g.
    an L2 flush) runs ahead of each timed replay, untimed."""
    graph = capture_graph(fn)
    graph.replay()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return sorted(times)[reps // 2]
