"""The engine's own scheduler on `nano` (llama3.1-8b), priced by measured step costs: a model,
not a measurement, of how the mixed-chunk rule spends the run.

The real Scheduler runs on the CPU with a fake model (every sampled token is 1, ignore_eos), so
the schedule is the engine's. Each step is priced from H100 measurements (tenth and eleventh
sessions):
- projections of M rows (32 layers): `PROJ_MS` (`gemm_shapes.py curve`, every 16 rows), linear
  between the points, at the decode bucket's rows (padding included) plus the chunk's; past
  512 rows a row costs LARGE_ROW_US (large prefill steps);
- decode attention: the running sequences' K/V (131,072 bytes a token) at KV_TBS plus a fixed
  cost a step;
- a step with a prompt chunk: CHUNK_ATTN_MS for the chunk's prefill attention (the mixed
  graphs' fixed grid, `profile_run.py`);
- lm_head, sampling and the row kernels: OTHER_MS plus OTHER_US_PER_ROW;
- steps the mixed graphs cannot run (more than P prompt tokens: due prompts) are eager:
  EAGER_MS of host time more.

It reproduces the tenth session's measured run's schedule exactly (steps by kind, riding
tokens by decode rows) and, with the tenth session's table, its time within 2% (the 16-row
table prices it about 5% high: 15.81 s against 14.9-15.1 s measured), but it ranked a chunk
that shrinks with the decode rows (R:LO:HI below) 2% ahead of P = 128 where the H100 put it
1-5% behind (RESULTS.md, tenth session). With the eleventh session's 16-row curve (the old
one had no point at 288, where cuBLAS steps up) it ranks those rules behind P = 128, as the
GPU did, but it put a chunk filling steps past 256 rows to 320 2% ahead where the GPU
measured no change: use it to see schedules, not to rank policies a few percent apart.

Usage: python examples/benchmarks/schedule_model.py [--no-ride] [P | R:LO:HI[/F] ...]
P: mixed_chunk_tokens. R:LO:HI: P = R - the decode bucket, within [LO, HI] (patched into the
scheduler). /F: a step with nothing decoding gives prompts F tokens instead of the budget.
--no-ride: prompt tokens do not fill a mixed step's padding decode rows (before 2026-11-23's
twentieth session; the engine's mixed_chunk_room).
Pure Python; runs anywhere. Prints, per setting, the modelled seconds, the steps by kind, and
the prompt tokens that rode in mixed steps by decode rows.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from batchgen.bench.workloads import nano
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.cuda_graph import bucket_sizes, smallest_bucket
from batchgen.engine.mixed_graph import mixed_bucket_sizes, padding_rows
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.sampling_params import SamplingParams

PROJ_MS = [(1, 5.30), (16, 5.32), (32, 5.41), (48, 5.47), (64, 5.40), (80, 5.54), (96, 5.60),
           (112, 5.70), (128, 5.78), (144, 5.93), (160, 6.02), (176, 6.18), (192, 6.28),
           (208, 6.46), (224, 6.88), (240, 6.90), (256, 6.93), (272, 7.77), (288, 8.62),
           (304, 8.15), (320, 8.14), (336, 9.07), (352, 9.35), (368, 9.08), (384, 9.41),
           (400, 11.33), (448, 14.80), (512, 11.12)]  # fmt: skip
LARGE_ROW_US = 19.0  # a prompt token's projections in large prefill steps (~720 TFLOP/s)
KV_TBS = 2.78  # decode attention over the run (profile_run.py: 5.6 s for 15.6 TB)
KV_BYTES = 2 * 32 * 8 * 128 * 2
ATTN_FIXED_MS = 0.26  # 32 calls of about 8 us
CHUNK_ATTN_MS = 0.58  # 32 calls of 18 us (profile_run.py)
PREFILL_ATTN_US = 1.5  # a prompt token's attention in large prefill steps
OTHER_MS = 0.45  # lm_head + sampling
OTHER_US_PER_ROW = 2.0  # silu, rope + store, norms, per row
EAGER_MS = 8.0  # host time an eager step adds (step_kinds.py: launch s of eager steps)
BLOCKS = 20000
BUCKETS = bucket_sizes(256)
MIXED_BUCKETS = mixed_bucket_sizes(256)


def proj_ms(m: int) -> float:
    if m > PROJ_MS[-1][0]:
        return PROJ_MS[-1][1] + (m - PROJ_MS[-1][0]) * LARGE_ROW_US / 1e3
    for (m0, t0), (m1, t1) in zip(PROJ_MS, PROJ_MS[1:]):
        if m <= m1:
            return t0 + (t1 - t0) * (max(m, m0) - m0) / (m1 - m0)
    raise AssertionError


def bucket(d: int, mixed: bool = False) -> int:
    """The graph bucket d decode rows run in (its rows are what the GEMMs see); mixed: a mixed
    step's graph, whose buckets are finer."""
    return smallest_bucket(MIXED_BUCKETS if mixed else BUCKETS, d) if d else 0


def rule(r: int, lo: int, hi: int):
    """P as a function of the decode rows d: fill the step's bucket to r rows, within [lo, hi]."""
    return lambda d: max(lo, min(hi, (r - bucket(d, mixed=True)) // 16 * 16))


def patch_allowance(sched: Scheduler, chunk_of, first: int = 0) -> None:
    """Give prompts that are not due chunk_of(decoding sequences) tokens a step (plus the
    riding room), keeping the engine's due rule and look-ahead; with first > 0, a step with
    nothing decoding gives prompts first tokens (none due) instead of the whole budget."""
    from batchgen.engine import scheduler as mod

    real = sched._prompt_allowance

    def allowance():
        a = real()
        decoding = sum(s.num_tokens - s.num_computed_tokens == 1 for s in sched.running)
        if a is None:
            return mod.PromptAllowance(first, 1 << 30) if first and not decoding else None
        room = sched.mixed_chunk_room(decoding) if sched.mixed_chunk_room else 0
        a.left = chunk_of(decoding) + room
        return a

    sched._prompt_allowance = allowance


def simulate(chunk, workload, first: int = 0, ride_padding: bool = True) -> dict:
    """chunk: P (int) or a function of the decode rows giving P. ride_padding: prompt tokens
    fill a mixed step's padding decode rows (the engine's default), else only P."""
    chunk_of = chunk if callable(chunk) else (lambda d: chunk)
    # A mixed step's padding decode rows, where prompt tokens ride (the engine's mixed_chunk_room).
    room = (lambda d: padding_rows(MIXED_BUCKETS, d)) if ride_padding else None
    bm = BlockManager(BLOCKS, 16, True)
    sched = Scheduler(
        bm,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        eos_token_ids=frozenset({0}),
        admission_interval=32,
        mixed_chunk_tokens=chunk_of(0),
        mixed_chunk_room=room,
    )
    if callable(chunk) or first:
        patch_allowance(sched, chunk_of, first)
    for i, (prompt, m) in enumerate(zip(workload.prompts, workload.max_tokens)):
        sched.add(Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True)))
    total = 0.0
    kinds = defaultdict(lambda: [0, 0.0, 0])  # kind -> steps, seconds, prompt tokens
    ride = defaultdict(int)  # decode rows // 32 -> prompt tokens in mixed steps
    while sched.has_unfinished():
        out = sched.schedule()
        decode = [s for s in out.scheduled if s.num_new_tokens == 1]
        prompt = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        d = len(decode)
        kv = sum(s.start + 1 for s in decode)
        ms = ATTN_FIXED_MS + kv * KV_BYTES / KV_TBS / 1e9 + OTHER_MS
        chunks = sum(1 for s in out.scheduled if s.num_new_tokens > 1)
        p = chunk_of(d)
        if prompt and prompt <= p + (room(d) if room else 0) and chunks <= 4:
            kind = "mixed-graph"
            ms += proj_ms(bucket(d, mixed=True) + p) + CHUNK_ATTN_MS
            ms += OTHER_US_PER_ROW * (d + p) / 1e3
            ride[d // 32] += prompt
        elif prompt:
            kind = "eager" if d else "prefill"
            ms += proj_ms(d + prompt) + OTHER_US_PER_ROW * (d + prompt) / 1e3
            ms += PREFILL_ATTN_US * prompt / 1e3 + EAGER_MS
        else:
            kind = "decode-graph"
            ms += proj_ms(bucket(d)) + OTHER_US_PER_ROW * d / 1e3
        total += ms
        k = kinds[kind]
        k[0] += 1
        k[1] += ms / 1e3
        k[2] += prompt
        sampled = {s.seq.seq_id: 1 for s in out.scheduled if s.samples}
        sched.postprocess(out, sampled)
    return {"seconds": total / 1e3, "kinds": dict(kinds), "ride": dict(ride)}


def main() -> None:
    # Arguments: P, or R:LO:HI for P = R - decode rows within [LO, HI]; /F after either: a
    # step with nothing decoding gives prompts F tokens.
    # --no-ride: prompt tokens do not fill a mixed step's padding decode rows.
    args = sys.argv[1:]
    ride = "--no-ride" not in args
    args = [a for a in args if a != "--no-ride"] or ["0", "128"]
    w = nano(256, 128256)
    for full in args:
        arg, _, first = full.partition("/")
        chunk = rule(*map(int, arg.split(":"))) if ":" in arg else int(arg)
        r = simulate(chunk, w, int(first or 0), ride)
        steps = sum(k[0] for k in r["kinds"].values())
        print(f"P={full}: {r['seconds']:.2f} s modelled, {steps} steps, "
              f"{w.num_output_tokens / r['seconds']:,.0f} tok/s")  # fmt: skip
        for kind, (n, s, p) in sorted(r["kinds"].items()):
            print(f"  {kind:<13} {n:>5} steps {s:6.2f} s {p:>7} prompt tokens")
        cells = [f"{32 * b}-: {t}" for b, t in sorted(r["ride"].items())]
        print("  riding prompt tokens by decode rows: " + ", ".join(cells))


if __name__ == "__main__":
    main()
