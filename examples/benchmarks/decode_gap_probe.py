"""Why mid-size decode batches read K/V below the ceiling: the split kernel's occupancy, and
the same bytes laid out as ragged (engine-like, longest first) or uniform contexts.

Usage (CUDA machine, repo root): python examples/benchmarks/decode_gap_probe.py

Contexts follow `nano` at the step where B sequences are still running: prompts of 100-1024
tokens plus t generated, t = 1024 - 924 * B / 256. If uniform contexts of the same total reach
the ceiling where ragged ones do not, the loss is the tail of unequal programs; if both fall
short, it is the parallelism of B * Hk programs.
"""

from __future__ import annotations

import os

import torch
import triton
from batchgen.kernels.decode_attention import (
    _decode_split_kernel,
    choose_num_splits,
    launch_decode,
)

from batchgen.bench.timing import graph_median_us

HQ, HK, D, BS = 16, 8, 128, 16
BATCHES = [int(b) for b in os.environ.get("GAP_BATCHES", "32,64,128,256").split(",") if b]


def occupancy() -> None:
    props = torch.cuda.get_device_properties(0)
    for cache in _decode_split_kernel.device_caches.values():
        for kernel in cache[0].values():
            md = kernel.metadata
            threads = 32 * md.num_warps
            by_regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * threads)
            by_smem = props.shared_memory_per_multiprocessor // max(1, md.shared)
            print(f"split kernel warps={md.num_warps} stages={md.num_stages}: "
                  f"{kernel.n_regs} regs, "
                  f"{kernel.n_spills} spills, shared {md.shared} B -> programs/SM by regs "
                  f"{by_regs}, by shared {by_smem}")  # fmt: skip


def batch(ctx: list[int], bs: int = BS, heads_major: bool = False):
    """A paged cache holding the contexts. heads_major stores each block as [Hk, bs, D] (one
    head's keys contiguous) and passes the kernel a [NB, bs, Hk, D] view of it."""
    b = len(ctx)
    width = max(-(-c // bs) for c in ctx)
    tables = torch.randperm(b * width, device="cuda").view(b, width).int()
    shape = (b * width, HK, bs, D) if heads_major else (b * width, bs, HK, D)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    if heads_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, lens, tables


def graph_ms(fn, calls: int = 20) -> float:
    """Milliseconds a call, from CUDA-graph replays of `calls` back-to-back calls (as the
    engine's layers run them, without do_bench's launch and L2-flush around each call)."""
    return graph_median_us(lambda: [fn() for _ in range(calls)], 5) / calls / 1e3


def rate(args, splits: int, tiles=(64, 4, 3), graphed: bool = False) -> float:
    fn = lambda: launch_decode(*args, D**-0.5, splits, *tiles)  # noqa: E731
    if graphed:
        ms = graph_ms(fn)
    else:
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    nbytes = 2 * int(args[3].sum()) * HK * D * 2
    return nbytes / ms / 1e9


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "SMs", sms)
    for b in BATCHES:
        t = round(1024 - 924 * b / 256)
        ragged = sorted((torch.randint(100, 1025, (b,), generator=gen) + t).tolist(), reverse=True)
        mean = round(sum(ragged) / b)
        default = choose_num_splits(b, HK, max(ragged), torch.device("cuda"))
        layouts = {
            "ragged, longest first": ragged,
            "ragged, shuffled": [ragged[i] for i in torch.randperm(b, generator=gen).tolist()],
            f"uniform {mean}": [mean] * b,
        }
        print(f"\nB={b}: contexts {min(ragged)}-{max(ragged)}, default splits {default}")
        for name, ctx in layouts.items():
            args = batch(ctx)
            cells = "  ".join(f"S={s}: {rate(args, s):.2f}" for s in (1, 2, 4, 8))
            print(f"  {name:<24} TB/s  {cells}")
            del args
        print("  CUDA-graph replays, ragged longest first, by cache layout:")
        for bs in (16, 64):
            for heads_major in (False, True):
                args = batch(ragged, bs, heads_major)
                cells = "  ".join(
                    f"S={s}: {rate(args, s, graphed=True):.2f}" for s in sorted({1, default})
                )
                layout = "[NB, Hk, bs, D]" if heads_major else "[NB, bs, Hk, D]"
                print(f"  bs={bs:<3} {layout:<16} TB/s  {cells}")
                del args
    fixed_cost()
    split_sweep(gen)
    occupancy()


def split_sweep(gen: torch.Generator) -> None:
    """TB/s by split count at the batch sizes a nano run passes through (CUDA graphs, engine-like
    ragged contexts, longest first), against choose_num_splits' pick."""
    print("\nSplit sweep: TB/s (CUDA graphs), ragged longest first; * marks the default")
    for b in (4, 8, 16, 24, 32, 48, 64, 96, 128, 192):
        t = round(1024 - 924 * b / 256)
        ctx = sorted((torch.randint(100, 1025, (b,), generator=gen) + t).tolist(), reverse=True)
        default = choose_num_splits(b, HK, max(ctx), torch.device("cuda"))
        args = batch(ctx)
        cells = []
        for s in sorted({1, 2, 3, 4, 6, 8, 12, 16, default}):
            mark = "*" if s == default else " "
            cells.append(f"{s}{mark}{rate(args, s, graphed=True):.2f}")
        print(f"  B={b:<4} " + "  ".join(cells), flush=True)
        del args


def fixed_cost() -> None:
    """Microseconds a call against context length, uniform contexts, CUDA-graph replays: the
    intercept of time against bytes is the per-call cost no K/V read pays for."""
    print("\nFixed cost: us a call (CUDA graphs), uniform contexts, default splits")
    for b in (4, 32, 64, 256):
        cells = []
        for ctx in (16, 256, 1024, 2048):
            splits = choose_num_splits(b, HK, ctx, torch.device("cuda"))
            args = batch([ctx] * b)
            ms = graph_ms(lambda a=args, s=splits: launch_decode(*a, D**-0.5, s, 64, 4, 3))
            cells.append(f"ctx {ctx}: {ms * 1e3:7.1f} (S={splits})")
            del args
        print(f"  B={b:<4}" + "  ".join(cells))


if __name__ == "__main__":
    main()
