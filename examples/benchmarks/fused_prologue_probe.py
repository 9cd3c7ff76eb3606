"""The decode rows' attention prologue inside the decode kernel (rope_store_decode) against the
prologue kernel then the decode kernel (rope_and_store_kv, paged_attention_decode), on
llama3.1-8b's heads with its folded input norm (row scale over 4,096 hidden values), bf16.

Usage (CUDA machine, repo root): python examples/benchmarks/fused_prologue_probe.py
Per batch size: contexts drawn from 100 to 2,047 keys (nano's range), 16-token blocks, one
cache per layer for LAYERS layers so K/V come from HBM; each form is captured as a CUDA graph
of LAYERS calls and replayed; prints us per layer for both forms and the decode kernel alone.
"""

from __future__ import annotations

import torch
from batchgen.kernels.decode_attention import paged_attention_decode, rope_store_decode
from batchgen.kernels.rope_store import rope_and_store_kv
from batchgen.kernels.rotary import build_cos_sin_cache

HQ, HK, D, BS, HIDDEN, LAYERS = 32, 8, 128, 16, 4096, 8


def setup(batch: int, gen: torch.Generator):
    lens = torch.randint(100, 2048, (batch,), generator=gen).sort(descending=True).values
    blocks = -(-lens // BS)
    width = int(blocks.max()) + 1
    num_blocks = int(blocks.sum()) + 8
    tables = torch.zeros(batch, width, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    at = 0
    for b, n in enumerate(blocks.tolist()):
        tables[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    slots = torch.tensor([int(tables[b, (n - 1) // BS]) * BS + (n - 1) % BS
                          for b, n in enumerate(lens.tolist())])  # fmt: skip
    dev = "cuda"
    caches = [
        (
            torch.randn(num_blocks, BS, HK, D, device=dev, dtype=torch.bfloat16),
            torch.randn(num_blocks, BS, HK, D, device=dev, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    return dict(
        qkv=torch.randn(batch, (HQ + 2 * HK) * D, device=dev, dtype=torch.bfloat16),
        positions=(lens - 1).to(dev),
        cos_sin=build_cos_sin_cache(D, 4096, 500000.0, None).to(dev),
        slots=slots.to(dev),
        seq_lens=lens.to(torch.int32).to(dev),
        tables=tables.to(dev),
        rows=torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16),
        caches=caches,
        max_len=int(lens.max()),
    )


def forms(c):
    scale = D**-0.5
    q_fixed = torch.randn(c["qkv"].shape[0], HQ, D, device="cuda", dtype=torch.bfloat16)

    def unfused():
        for k, v in c["caches"]:
            q = rope_and_store_kv(c["qkv"], c["positions"], c["cos_sin"], HQ, HK, k, v,
                                  c["slots"], rms_rows=c["rows"])  # fmt: skip
            paged_attention_decode(q, k, v, c["seq_lens"], c["tables"], scale,
                                   max_seq_len=c["max_len"])  # fmt: skip

    def fused():
        for k, v in c["caches"]:
            rope_store_decode(c["qkv"], c["positions"], c["cos_sin"], HQ, HK, k, v, c["slots"],
                              c["seq_lens"], c["tables"], scale, rms_rows=c["rows"],
                              max_seq_len=c["max_len"])  # fmt: skip

    def decode_only():
        for k, v in c["caches"]:
            paged_attention_decode(q_fixed, k, v, c["seq_lens"], c["tables"], scale,
                                   max_seq_len=c["max_len"])  # fmt: skip

    return {"prologue + decode": unfused, "fused": fused, "decode alone": decode_only}


def time_graph(fn, reps: int = 20) -> float:
    """us per layer of fn captured as one CUDA graph, median of reps replays."""
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'batch':>5} " + " ".join(f"{k:>18}" for k in forms(setup(1, gen))))
    for batch in (8, 32, 64, 128, 192, 256):
        c = setup(batch, gen)
        row = {name: time_graph(fn) for name, fn in forms(c).items()}
        # Interleave a second pass so a clock or neighbour drift shows as a spread.
        row2 = {name: time_graph(fn) for name, fn in forms(c).items()}
        cells = " ".join(f"{row[k]:8.1f} / {row2[k]:7.1f}" for k in row)
        print(f"{batch:>5} {cells}", flush=True)


if __name__ == "__main__":
    main()
