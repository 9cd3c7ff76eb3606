"""The CUDA-graph timer the bench probes share: replays, timed by CUDA events, as the engine's
decode steps run (no per-call launch cost from Python)."""

from __future__ import annotations

import torch


def graph_median_us(fn, reps: int, before=None) -> float:
    """Median microseconds of a CUDA-graph replay of fn over reps timed replays. fn runs once
    eagerly first (kernels compile outside the capture), is captured once and replayed once
    untimed; `before` (e.g. an L2 flush) runs ahead of each timed replay, untimed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]
