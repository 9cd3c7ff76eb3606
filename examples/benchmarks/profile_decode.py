"""Profile decode steps of the `nano` workload: where a step's time goes, GPU kernels and host.

Usage (CUDA machine, repo root):
    python examples/benchmarks/profile_decode.py [PRESET] [STEPS] [REQUESTS]
REQUESTS (default 256) takes the first requests of the workload: a small number profiles the
small-batch tail of a run, where per-kernel launch cost rather than bytes sets the step time.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.bench.engine_run import build_bench, submit
from batchgen.bench.random_model import preset_config
from batchgen.bench.workloads import nano
from batchgen.config import EngineConfig


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    requests = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    config = EngineConfig(model="-", dtype="bfloat16", device="cuda")
    vocab = preset_config(preset)["vocab_size"]
    w = nano(requests, vocab)
    bench = build_bench(config, preset, None, w.max_request_len())
    engine = bench.engine()
    submit(engine, w, "p")
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    print(f"{preset}: {len(engine.scheduler.running)} running, {wall * 1e3:.2f} ms per decode step")
    context_tokens = 0  # keys the decode kernels read over the profiled steps, per layer
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            context_tokens += sum(s.num_computed_tokens + 1 for s in engine.scheduler.running)
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    mc = engine.model_config
    kv_bytes = context_tokens * 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    split_us = sum(e.self_device_time_total for e in table if e.key == "_decode_split_kernel")
    if split_us:
        print(f"decode attention: {split_us / steps / 1e3:.2f} ms per step, "
              f"{kv_bytes / (split_us * 1e-6) / 1e12:.2f} TB/s of K/V")  # fmt: skip
    print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    gpu_us = sum(e.self_device_time_total for e in table)
    print(f"GPU busy per step: {gpu_us / steps / 1e3:.2f} ms of {wall * 1e3:.2f} ms wall")


if __name__ == "__main__":
    main()
