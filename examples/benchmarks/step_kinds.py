"""Where a `nano` run's time goes by step kind: decode steps replayed as CUDA graphs, and
steps that carry a prompt chunk replayed as mixed graphs, and steps launched eagerly (split into
the large admission steps and the rest); then the same by decode rows, in buckets of 32.

Usage (CUDA machine, repo root): python examples/benchmarks/step_kinds.py PRESET [key=value ...]
key=value are engine options (integers), e.g. max_num_batched_tokens=8192. Per kind: steps,
GPU seconds (CUDA events around each step's launch), host seconds spent launching, wall
seconds of the engine steps that launched them, and the mean decode rows and prompt tokens.
The eighth session ran this on the fourth session's mixed-step graphs (426fc855ac), whose
runner also had a "mixed-graph" kind; RESULTS.md has those numbers.
"""

from __future__ import annotations

import collections
import sys
import time

import torch

from batchgen.bench.engine_run import build_bench, drain, submit
from batchgen.bench.workloads import nano, warmup_workload
from batchgen.config import EngineConfig
from batchgen.engine import model_runner

BIG_PREFILL = 2048  # prompt tokens above which an eager step counts as an admission step


def main() -> None:
    preset = sys.argv[1]
    opts = {k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[2:])}
    w = nano(256, 151936 if preset.startswith("qwen") else 128256)
    config = EngineConfig(model="-", dtype="bfloat16", device="cuda", **opts)
    bench = build_bench(config, preset, None, w.max_request_len())
    engine = bench.engine()
    submit(engine, warmup_workload(w, engine.model_config.vocab_size, 16), "warmup-")
    drain(engine)
    records = []  # [kind, decode rows, prompt tokens, start event, end event, host s, step s]
    launch = model_runner.ModelRunner.launch

    def timed_launch(self, scheduled, sampling, previous=None):
        step = model_runner.build_step_inputs(scheduled, self.block_size)
        if self.graphs is not None and self.graphs.can_run(step):
            kind = "decode-graph"
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(step):
            kind = "mixed-graph"
        else:
            kind = "eager"
        d = step.num_decode_rows
        c = len(step.input_ids) - d
        if kind == "eager" and c > BIG_PREFILL:
            kind = "eager (admission)"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        handle = launch(self, scheduled, sampling, previous)
        host = time.perf_counter() - t0
        end.record()
        records.append([kind, d, c, start, end, host, 0.0])
        return handle

    model_runner.ModelRunner.launch = timed_launch
    submit(engine, w, "")
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    while engine.has_unfinished_requests():
        n = len(records)
        t0 = time.perf_counter()
        engine.step()
        if len(records) > n:
            records[-1][6] = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_all
    model_runner.ModelRunner.launch = launch
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0])
    for kind, d, c, start, end, host, step_s in records:
        a = agg[kind]
        a[0] += 1
        a[1] += start.elapsed_time(end) / 1e3
        a[2] += host
        a[3] += step_s
        a[4] += d
        a[5] += c
    print(f"{preset} {opts}: wall {wall:.2f} s, {len(records)} steps, "
          f"{w.num_output_tokens / wall:,.0f} output tok/s (the timers add host work)")  # fmt: skip
    print(f"  {'kind':<18} {'steps':>6} {'GPU s':>7} {'launch s':>8} {'step s':>7} "
          f"{'decode rows':>11} {'prompt tok':>10}")  # fmt: skip
    for kind, (n, gpu, host, step_s, d, c) in sorted(agg.items()):
        print(f"  {kind:<18} {n:>6} {gpu:>7.2f} {host:>8.2f} {step_s:>7.2f} {d / n:>11.1f} "
              f"{c / n:>10.1f}")  # fmt: skip
    # By decode rows (buckets of 32): per kind, steps and mean GPU ms, and the prompt tokens.
    by_rows = collections.defaultdict(lambda: [0, 0.0, 0])
    for kind, d, c, start, end, *_ in records:
        a = by_rows[(kind, min(d, 256) // 32)]
        a[0] += 1
        a[1] += start.elapsed_time(end)
        a[2] += c
    print(f"  {'kind':<18} {'rows':>9} {'steps':>6} {'GPU ms/step':>11} {'prompt tok':>10}")
    for (kind, b), (n, ms, c) in sorted(by_rows.items()):
        rows = f"{32 * b}-{32 * b + 31}"
        print(f"  {kind:<18} {rows:>9} {n:>6} {ms / n:>11.2f} {c:>10}")


if __name__ == "__main__":
    main()
