"""A schedule model of `nano` on llama3.1-8b built on measured step costs (a model, not a
measurement): how much prompts riding in decode steps could take off a run.

The costs are the H100 medians of `mixed_step_probe.py` (eighth session, CUDA-graph replays):
a decode step of B sequences (`DECODE_MS`, interpolated), a prompt chunk of C <= 256 tokens
riding in it (`RIDE_MS_PER_256` per 256 tokens, more above 256 at large-chunk prefill's rate
of 16.5 us a token), and prefill in large chunks (`PREFILL_US` a token). Host time, sampling
and launch gaps are left out: the engine's measured run is about 0.35 s slower than this
model's `fcfs` line.

Policies:
- fcfs: today's engine. Prompts in submission order, 16,384 tokens a step until all are in.
- ride P: prompts longest max_tokens first. The first step fills the token budget (so there
  are decode rows); after that each step carries at most P prompt tokens. A prompt that would
  otherwise end after the longest running sequence is "due" and is prefilled at once.
- total S: the fourth session's rule. A step's decode rows plus prompt tokens stay under S.

Usage: python examples/benchmarks/ride_model.py
Pure Python; runs anywhere.
"""

from __future__ import annotations

from batchgen.bench.workloads import nano

DECODE_MS = [(1, 6.2), (32, 8.50), (64, 10.21), (128, 12.80), (256, 15.11)]  # (B, ms)
RIDE_MS_PER_256 = 3.8  # measured 3.2-4.4 ms at B = 32-256
PREFILL_US = 23.5  # a prompt token in 2048-token chunks
BUDGET = 16384  # tokens of a step with no decode rows (max_num_batched_tokens)
DUE_SLACK = 16  # steps


def decode_ms(b: int) -> float:
    if b <= 0:
        return 0.0
    for (b0, t0), (b1, t1) in zip(DECODE_MS, DECODE_MS[1:]):
        if b <= b1:
            return t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    return DECODE_MS[-1][1]


def ride_ms(c: int) -> float:
    return RIDE_MS_PER_256 * min(c, 256) / 256 + max(0, c - 256) * 16.5e-3


def simulate(prompt_lens, max_tokens, policy: str, limit: int = 0) -> tuple[float, int]:
    """(seconds, steps) of one run; a running sequence is [prompt tokens left, outputs left]."""
    n = len(prompt_lens)
    order = list(range(n))
    if policy != "fcfs":
        order.sort(key=lambda i: -max_tokens[i])
    waiting, running = order, []
    ms, steps = 0.0, 0
    while waiting or running:
        decoding = [r for r in running if r[0] == 0]
        if policy == "fcfs" or not decoding:
            prefill = _fill(running, waiting, prompt_lens, max_tokens, BUDGET)
            cost = decode_ms(len(decoding)) + prefill * PREFILL_US / 1e3
        else:
            allowance = limit if policy == "ride" else max(0, limit - len(decoding))
            horizon = max(r[1] for r in running)
            due = 0
            while waiting and max_tokens[waiting[0]] + DUE_SLACK >= horizon:
                i = waiting.pop(0)
                running.append([0, max_tokens[i]])
                due += prompt_lens[i]
            chunk = _fill(running, waiting, prompt_lens, max_tokens, allowance)
            cost = decode_ms(len(decoding)) + ride_ms(chunk) + due * PREFILL_US / 1e3
        ms += cost
        steps += 1
        for r in decoding:
            r[1] -= 1
        running = [r for r in running if r[0] or r[1] > 0]
    return ms / 1e3, steps


def _fill(running, waiting, prompt_lens, max_tokens, budget: int) -> int:
    """Give up to `budget` prompt tokens: running prompts first, then waiting ones in order."""
    used = 0
    for r in running:
        if r[0] and used < budget:
            take = min(r[0], budget - used)
            r[0] -= take
            used += take
    while waiting and used < budget:
        i = waiting.pop(0)
        take = min(prompt_lens[i], budget - used)
        running.append([prompt_lens[i] - take, max_tokens[i]])
        used += take
    return used


def main() -> None:
    w = nano(256, 128256)
    lens = [len(p) for p in w.prompts]
    out = list(w.max_tokens)
    print(f"{'policy':<12} {'model s':>8} {'steps':>6} {'out tok/s':>9}")
    runs = [("fcfs", 0)] + [("ride", p) for p in (128, 256, 512)] + [("total", 384)]
    for policy, limit in runs:
        s, steps = simulate(lens, out, policy, limit)
        label = policy if policy == "fcfs" else f"{policy} {limit}"
        print(f"{label:<12} {s:>8.2f} {steps:>6} {sum(out) / s:>9,.0f}")


if __name__ == "__main__":
    main()
