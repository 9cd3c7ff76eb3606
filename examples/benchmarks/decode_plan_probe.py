"""Decode attention with equal splits per sequence against a DecodePlan (splits balanced over
the batch), on the contexts a llama3.1-8b `nano` run has when B sequences decode.

Usage (CUDA machine, repo root): python examples/benchmarks/decode_plan_probe.py [B ...]

The contexts come from the engine's own Scheduler run on the CPU over `nano` (fake model,
every token 1), so they are the run's. Each timing is a CUDA-graph replay of 32 calls, one
per layer over its own cache (32 x the batch's K/V, so nothing stays in L2), as the engine's
graphs run them; TB/s counts the K/V bytes read.
"""

from __future__ import annotations

import sys

import torch
from batchgen.kernels.decode_attention import (
    DecodePlan,
    choose_num_splits,
    launch_decode,
    plan_units,
    split_plan,
)

from batchgen.bench.timing import graph_median_us
from batchgen.bench.workloads import nano
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.sampling_params import SamplingParams

HQ, HK, D, BS, LAYERS, MAX_LEN = 32, 8, 128, 16, 32, 4096
TILES = (64, 4, 3)
DEFAULT_BATCHES = (8, 24, 40, 56, 72, 96, 128, 160, 200, 250)


def nano_contexts(batches) -> dict[int, list[int]]:
    """Decode contexts (longest first, as the engine orders them) at the first step of a nano
    run with each wanted number of decoding sequences (within 2)."""
    w = nano(256, 128256)
    sched = Scheduler(
        BlockManager(20000, BS, True),
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=MAX_LEN,
        eos_token_ids=frozenset({0}),
        admission_interval=32,
        mixed_chunk_tokens=128,
    )
    for i, (prompt, m) in enumerate(zip(w.prompts, w.max_tokens)):
        sched.add(Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True)))
    found: dict[int, list[int]] = {}
    while sched.has_unfinished() and len(found) < len(batches):
        out = sched.schedule()
        ctx = [s.start + 1 for s in out.scheduled if s.num_new_tokens == 1]
        for b in batches:
            if b not in found and abs(len(ctx) - b) <= 2:
                found[b] = ctx
        sched.postprocess(out, {s.seq.seq_id: 1 for s in out.scheduled if s.samples})
    return found


def layer_caches(ctx: list[int]):
    """q, per-layer (k, v) caches holding the contexts in shuffled blocks, lens, tables."""
    need = [-(-c // BS) for c in ctx]
    blocks = sum(need)
    order = torch.randperm(blocks).tolist()
    tables = torch.zeros(len(ctx), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n])
        del order[:n]
    tables = tables.cuda()
    caches = []
    for _ in range(LAYERS):
        kv = torch.empty(2, blocks, BS, HK, D, device="cuda", dtype=torch.bfloat16).normal_()
        caches.append((kv[0], kv[1]))
    q = torch.randn(len(ctx), HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    return q, caches, lens, tables


def tbs(q, caches, lens, tables, ctx, splits=None, plan=None) -> float:
    def run():
        for k, v in caches:
            launch_decode(q, k, v, lens, tables, D**-0.5, splits or 1, *TILES, plan=plan)

    us = graph_median_us(run, 5)
    return LAYERS * sum(ctx) * HK * D * 2 * 2 / us / 1e6


def plan_for(ctx: list[int], units: int, min_keys: int) -> tuple[DecodePlan, int]:
    unit_seq, starts, splits = split_plan(ctx, units, min_keys)
    t = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (unit_seq, starts, splits)]
    return DecodePlan(*t), sum(splits)


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or list(DEFAULT_BATCHES)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "TB/s of K/V; 32 layers a replay")
    for _, ctx in sorted(nano_contexts(batches).items()):
        args = layer_caches(ctx)
        default = choose_num_splits(len(ctx), HK, MAX_LEN, dev)
        cells = [f"equal {default}: {tbs(*args, ctx, splits=default):.2f}"]
        for waves in (2, 3, 4, 6):
            units = max(len(ctx), -(-waves * 4 * torch.cuda.get_device_properties(0)
                                      .multi_processor_count // HK))  # fmt: skip
            for min_keys in (128, 256):
                plan, used = plan_for(ctx, units, min_keys)
                cells.append(f"w{waves}/k{min_keys} ({used}u): {tbs(*args, ctx, plan=plan):.2f}")
        plan, used = plan_for(ctx, plan_units(len(ctx), HK, dev), 256)
        cells.append(f"default plan ({used}u): {tbs(*args, ctx, plan=plan):.2f}")
        print(f"B={len(ctx)} (ctx {min(ctx)}-{max(ctx)}, mean {sum(ctx) // len(ctx)}):", flush=True)
        print("   " + "  ".join(cells), flush=True)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
