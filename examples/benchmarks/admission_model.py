"""A cost model (not a measurement) of the `nano` workload on llama3.1-8b under two admission
policies, to size the next scheduling step before building it.

Each step costs max(weight bytes / BW, 2 * params * rows / FLOPS) + KV bytes read / BW + a fixed
overhead, with rows = decode rows + prompt tokens in the step. Policies:
- fcfs: prompts in submission order; while decodes run, up to --mixed-budget prompt tokens a
  step ride along (8192 = today's engine: every prompt is admitted in the first steps);
- longest-first: prompts in decreasing max_tokens order (exact here, since nano ignores EOS),
  with the same budget.

Usage: python examples/benchmarks/admission_model.py [--bw 2.9e12] [--flops 650e12]
Pure Python; runs anywhere.
"""

from __future__ import annotations

import argparse

from batchgen.bench.workloads import nano

PARAMS = 7.5e9  # llama3.1-8b weights read per decode step (non-embedding + lm_head)
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def simulate(prompt_lens, max_tokens, order, mixed_budget, bw, flops, overhead):
    """(seconds, steps) of one run; each sequence is [prompt left, context, output left]."""
    waiting = list(order)
    running: list[list[int]] = []
    seconds, steps = 0.0, 0
    while waiting or running:
        decoding = [r for r in running if r[0] == 0]
        budget = mixed_budget if decoding else 8192
        prefill = 0
        for r in running:  # chunks of prompts already admitted go first
            if r[0] and prefill < budget:
                n = min(r[0], budget - prefill)
                r[0], r[1], prefill = r[0] - n, r[1] + n, prefill + n
        while waiting and prefill < budget:
            i = waiting.pop(0)
            n = min(prompt_lens[i], budget - prefill)
            running.append([prompt_lens[i] - n, n, max_tokens[i]])
            prefill += n
        rows = len(decoding) + prefill
        kv = sum(r[1] for r in decoding) * KV_BYTES_PER_TOKEN
        seconds += max(PARAMS * 2 / bw, 2 * PARAMS * rows / flops) + kv / bw + overhead
        for r in decoding:
            r[1], r[2] = r[1] + 1, r[2] - 1
        running = [r for r in running if r[2] > 0]
        steps += 1
    return seconds, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bw", type=float, default=2.9e12, help="HBM bytes/s")
    parser.add_argument("--flops", type=float, default=650e12, help="bf16 FLOP/s of the GEMMs")
    parser.add_argument("--overhead", type=float, default=0.3e-3, help="fixed s per step")
    opts = parser.parse_args()
    w = nano(256, 128256)
    lens = [len(p) for p in w.prompts]
    out = w.max_tokens
    orders = {
        "fcfs": list(range(len(lens))),
        "longest-first": sorted(range(len(lens)), key=lambda i: -out[i]),
    }
    print(f"{'policy':<14} {'mixed budget':>12} {'model s':>8} {'steps':>6} {'out tok/s':>9}")
    for name, order in orders.items():
        for budget in (8192, 1024, 512, 256):
            s, n = simulate(lens, out, order, budget, opts.bw, opts.flops, opts.overhead)
            print(f"{name:<14} {budget:>12} {s:>8.2f} {n:>6} {sum(out) / s:>9,.0f}")


if __name__ == "__main__":
    main()
