"""Throughput of `nano` with history penalties (repetition, frequency/presence) or, with
`filters`, top-k/top-p/min-p filters, against plain temperature sampling, same engine and
requests: what a job that sets them pays.

Usage (CUDA machine, repo root): python examples/benchmarks/penalty_probe.py [filters] [PRESET]
[N] (PRESET default qwen3-0.6b; N requests, default 256).
`penalty_probe.py step [filters] [VOCAB]`: one sampling step alone (Sampler.sample, 256 and 16
rows of 1,100-id histories, bf16 logits of VOCAB ids, default 151,936) per variant: host us to
enqueue it and us a step back to back (the larger of host and GPU).
"""

from __future__ import annotations

import sys
import time

import torch
from nano_engine import nano_bench

from batchgen.bench.engine_run import drain, submit, warm_up
from batchgen.bench.timing import synchronize, timed
from batchgen.bench.workloads import Workload
from batchgen.engine.penalties import History
from batchgen.engine.sampler import Sampler, SamplingBatch
from batchgen.engine.sequence import PENDING_TOKEN
from batchgen.sampling_params import SamplingParams

PENALTIES = {
    "plain": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "frequency 0.2 + presence 0.1": {"frequency_penalty": 0.2, "presence_penalty": 0.1},
}
FILTERS = {
    "plain": {},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 50 + top-p 0.95": {"top_k": 50, "top_p": 0.95},
    "min-p 0.05": {"min_p": 0.05},
}


def timed_run(engine, w: Workload, prefix: str, sampling: dict) -> float:
    """Seconds to drain the queued requests (submission not timed), after two short requests
    with the same settings (so a kernel they need is compiled before the timing)."""
    submit(engine, Workload(w.name, w.prompts[:2], [2, 2]), f"warm-{prefix}", **sampling)
    drain(engine)
    submit(engine, w, prefix, **sampling)
    seconds, errors = timed(lambda: drain(engine), engine.runner.device)
    assert errors == 0, f"{errors} error outputs"
    return seconds


def sampler_step(vocab: int, variants: dict, length: int = 1100, reps: int = 100) -> None:
    """Per variant, at 256 and 16 rows and two logit scales (randn x 1: flat, as the random
    models give; x 4: peaked, more like a trained model): host us to enqueue Sampler.sample,
    and us a step over reps back to back."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    for rows, scale in ((256, 1.0), (256, 4.0), (16, 1.0)):
        logits = (scale * torch.randn(rows, vocab, generator=g)).to(device, torch.bfloat16)
        prompts = [
            torch.randint(0, min(vocab, 10000), (length,), generator=g).tolist()
            for _ in range(rows)
        ]
        for name, sampling in variants.items():
            params = [SamplingParams(temperature=0.6, **sampling)] * rows
            penalised = params[0].has_penalties
            sampler = Sampler()
            ids = [list(p[: length // 2]) for p in prompts]
            histories = [History(i, ids[i], length // 2) for i in range(rows)]
            batch = SamplingBatch(
                params, list(range(rows)), [0] * rows,
                histories if penalised else [None] * rows, [[]] * rows,
            )  # fmt: skip
            host = []
            for rep in range(2 * reps):  # the first reps warm (compiles, buffers)
                if rep == reps:
                    synchronize(device)
                    start = time.perf_counter()
                t0 = time.perf_counter()
                sampler.sample(logits, batch)
                host.append(time.perf_counter() - t0)
                batch.steps[:] = [rep + 1] * rows
                for h in ids:
                    h.append(PENDING_TOKEN)  # the drawn token, in flight: as the engine's lists
            synchronize(device)
            step = (time.perf_counter() - start) / reps
            print(f"step {rows:3d} rows x{scale:.0f} {name:28s} host "
                  f"{1e6 * sum(host[reps:]) / reps:7.0f} us, back to back {1e6 * step:7.0f} us "
                  "a step", flush=True)  # fmt: skip


def main() -> None:
    args = sys.argv[1:]
    step = args[:1] == ["step"]
    args = args[step:]
    variants = PENALTIES
    if args[:1] == ["filters"]:
        variants, args = FILTERS, args[1:]
    if step:
        sampler_step(int(args[0]) if args else 151_936, variants)
        return
    preset = args[0] if args else "qwen3-0.6b"
    n = int(args[1]) if len(args) > 1 else 256
    bench, w, _ = nano_bench(preset)
    w = Workload(w.name, w.prompts[:n], w.max_tokens[:n])
    out_tokens = sum(w.max_tokens)
    engine = bench.engine(enable_prefix_caching=False)
    warm_up(engine, w)
    for i, name in enumerate(["plain", *variants]):  # plain twice: the first run warms
        s = timed_run(engine, w, f"{i}-", variants[name])
        print(f"{preset} {n} requests, {name:30s} {s:7.2f} s {out_tokens / s:9,.0f} tok/s",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
