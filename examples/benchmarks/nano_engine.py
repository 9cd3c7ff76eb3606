"""The engine the profiling scripts share: a random-weight preset on CUDA, prefix caching off
(so repeated passes over the same prompts all compute), warmed up on nano-shaped requests."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.bench.engine_run import build_bench, drain, submit
from batchgen.bench.random_model import preset_config
from batchgen.bench.workloads import Workload, nano, warmup_workload
from batchgen.config import EngineConfig


def nano_bench(preset: str):
    """(Bench, the 256-request nano workload, vocab size) configured as `batchgen bench` runs
    it (prefix caching on): each timed run takes a fresh engine from the Bench."""
    vocab = preset_config(preset)["vocab_size"]
    w: Workload = nano(256, vocab)
    config = EngineConfig(model="-", dtype="bfloat16", device="cuda")
    return build_bench(config, preset, None, w.max_request_len()), w, vocab


def warm_nano_engine(preset: str):
    """(engine, the 256-request nano workload) with kernels compiled and graphs captured."""
    config = EngineConfig(model="-", dtype="bfloat16", device="cuda", enable_prefix_caching=False)
    vocab = preset_config(preset)["vocab_size"]
    w: Workload = nano(256, vocab)
    engine = build_bench(config, preset, None, w.max_request_len()).engine()
    submit(engine, warmup_workload(w, vocab, 16), "warmup-")
    drain(engine)
    return engine, w


def profiled_nano_run(preset: str):
    """Warm the engine, run nano once untimed and once timed (printing its wall), then once
    under the CUDA-only profiler. Returns (the profiler, the profiled run's wall seconds)."""
    engine, w = warm_nano_engine(preset)
    submit(engine, w, "untimed-")
    drain(engine)
    submit(engine, w, "timed-")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    drain(engine)
    torch.cuda.synchronize()
    print(f"{preset}: nano run {time.perf_counter() - t0:.3f} s wall (unprofiled)")
    submit(engine, w, "profiled-")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        drain(engine)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall
