"""Profile the admission phase of the `nano` workload: the steps that prefill all 256 prompts
(chunked into the token budget, with the admitted sequences' decodes riding along).

Usage (CUDA machine, repo root): python examples/benchmarks/profile_admission.py [PRESET]
Prints the wall time of the admission steps timed alone, then a kernel table of the same steps
on a second engine run under the profiler, then the host's Python hot spots of a third run
under cProfile (where the host time goes when admission is host-bound).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
from nano_engine import warm_nano_engine
from torch.profiler import ProfilerActivity, profile

from batchgen.bench.engine_run import drain, submit


def admit(engine) -> int:
    """Step until every prompt is computed; returns the number of steps."""
    steps = 0
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
        steps += 1
    return steps


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    # Prefix caching off there: the timed and the profiled pass submit the same prompts.
    engine, w = warm_nano_engine(preset)
    for label in ("timed", "profiled", "host"):
        submit(engine, w, label)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if label == "timed":
            steps = admit(engine)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            per_step = wall / steps * 1e3
            print(f"{preset}: admission {steps} steps, {wall:.3f} s ({per_step:.1f} ms/step)")
        elif label == "host":
            host = cProfile.Profile()
            host.enable()
            steps = admit(engine)
            torch.cuda.synchronize()
            host.disable()
            print(f"host profile of {steps} admission steps (cProfile, by own time):")
            pstats.Stats(host).sort_stats("tottime").print_stats(25)
        else:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                steps = admit(engine)
                torch.cuda.synchronize()
            table = prof.key_averages()
            print(
                table.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
            )
            gpu_us = sum(e.self_device_time_total for e in table)
            print(f"GPU busy over {steps} admission steps: {gpu_us / 1e6:.3f} s")
        drain(engine)


if __name__ == "__main__":
    main()
