"""Probe: can the H100 overlap one half-batch's decode attention (memory-bound) with the other
half's projections and small kernels (latency-bound)? qwen3-0.6b-shaped layers, 28 of them, in
a CUDA graph: the whole batch on one stream (today's step) against two half-batches on two
streams with no dependency between them (the most a two-batch overlap could get).

Usage (CUDA machine, repo root): python examples/benchmarks/overlap_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from batchgen.kernels import ops

from batchgen.bench.timing import graph_median_us

LAYERS, H, HQ, HK, D, INTER, BS = 28, 1024, 16, 8, 128, 3072, 16
DEV = torch.device("cuda")
BF = torch.bfloat16


def make_layers():
    def w(n, k):
        return torch.randn(n, k, device=DEV, dtype=BF) * 0.02

    return [
        dict(qkv=w((HQ + 2 * HK) * D, H), o=w(H, HQ * D), gu=w(2 * INTER, H), d=w(H, INTER),
             g1=torch.ones(H, device=DEV, dtype=BF), g2=torch.ones(H, device=DEV, dtype=BF))
        for _ in range(LAYERS)
    ]  # fmt: skip


def make_batch(b: int, gen: torch.Generator):
    """Ragged contexts (100-2048, longest first) in a paged cache shared by the layers."""
    ctx = sorted(torch.randint(100, 2049, (b,), generator=gen).tolist(), reverse=True)
    per = [-(-c // BS) for c in ctx]
    width = -(-max(per) // 16) * 16
    pool = sum(per)
    ids = torch.randperm(pool, generator=gen)
    tables = torch.zeros(b, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per):
        tables[i, :n] = ids[at : at + n]
        at += n
    k_cache = torch.randn(pool, BS, HK, D, device=DEV, dtype=BF)
    return dict(
        x=torch.randn(b, H, device=DEV, dtype=BF),
        res=torch.randn(b, H, device=DEV, dtype=BF),
        lens=torch.tensor(ctx, dtype=torch.int32, device=DEV),
        tables=tables.to(DEV),
        k=k_cache,
        v=torch.randn_like(k_cache),
        bytes=2 * sum(ctx) * HK * D * 2 * LAYERS,
    )


def step(layers, batch) -> None:
    """One decode step's kernels for a batch: per layer norm, qkv, attention, o, norm,
    gate_up, silu, down (rotary and the cache write left out)."""
    x, res = batch["x"], batch["res"]
    for lw in layers:
        h, res = ops.fused_add_rms_norm(x, res, lw["g1"], 1e-6)
        qkv = F.linear(h, lw["qkv"])
        q = qkv[:, : HQ * D].view(-1, HQ, D)
        a = ops.paged_attention_decode(
            q, batch["k"], batch["v"], batch["lens"], batch["tables"], D**-0.5, max_seq_len=2048
        )
        o = F.linear(a.view(-1, HQ * D), lw["o"])
        h, res = ops.fused_add_rms_norm(o, res, lw["g2"], 1e-6)
        x = F.linear(ops.silu_and_mul(F.linear(h, lw["gu"])), lw["d"])


def time_graph(fn, reps: int = 20) -> float:
    """Median milliseconds of a CUDA-graph replay of fn."""
    return graph_median_us(fn, reps) / 1e3


def attention_only(batch) -> None:
    q = batch["x"].new_empty(batch["x"].shape[0], HQ, D)
    for _ in range(LAYERS):
        ops.paged_attention_decode(
            q, batch["k"], batch["v"], batch["lens"], batch["tables"], D**-0.5, max_seq_len=2048
        )


def probe(b: int, layers, gen: torch.Generator, side: torch.cuda.Stream) -> None:
    whole = make_batch(b, gen)
    halves = []
    for rows in (slice(0, None, 2), slice(1, None, 2)):
        half = dict(whole)
        for key in ("x", "res", "lens", "tables"):
            half[key] = whole[key][rows].contiguous()
        halves.append(half)

    def two_streams():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        step(layers, halves[0])
        with torch.cuda.stream(side):
            step(layers, halves[1])
        main_stream.wait_stream(side)

    def serial_halves():
        step(layers, halves[0])
        step(layers, halves[1])

    one = time_graph(lambda: step(layers, whole))
    two = time_graph(two_streams)
    ser = time_graph(serial_halves)
    attn = time_graph(lambda: attention_only(whole))
    print(
        f"B={b:3d}: whole batch one stream {one:6.3f} ms; halves on two streams {two:6.3f} ms; "
        f"halves one after the other {ser:6.3f} ms; attention alone {attn:6.3f} ms "
        f"({whole['bytes'] / attn / 1e9:.2f} TB/s)",
        flush=True,
    )


def main() -> None:
    layers = make_layers()
    gen = torch.Generator().manual_seed(0)
    side = torch.cuda.Stream()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for b in (32, 64, 128, 256):
        probe(b, layers, gen, side)


if __name__ == "__main__":
    main()
