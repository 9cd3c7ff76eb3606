"""Probe: can the decode GEMMs' latency floor be hidden by warming L2 with the next projection's
weights on a side stream, while the current projection (and attention) run?

A CUDA graph of 28 qwen3-0.6b-shaped decode layers (norm -> qkv -> copy -> paged decode
attention over nano-like contexts -> o -> norm -> gate_up -> act -> down), L2 flushed before
each replay. Variants fork a prefetch of GEMM i+d's weight onto a second stream just before
GEMM i, as `cp.async.bulk.prefetch.L2` ("bulk") or as plain loads kept in L2 ("load").

First it measures the floor itself: one projection replayed with its weight resident in L2
(the same weight N times) against N distinct weights (each read from DRAM).

Usage (CUDA machine, repo root): python examples/benchmarks/l2_sidestream_probe.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from batchgen.kernels.decode_attention import choose_num_splits, launch_decode

from batchgen.bench.timing import graph_median_us

sys.path.insert(0, str(Path(__file__).parent))
from decode_gap_probe import BS, HK, batch  # noqa: E402
from probe_chain import (  # noqa: E402
    INTER,
    LAYERS,
    H,
    Q,
    layer_weights,
    prefetch_l2_share,
    row_op_body,
)

BATCHES = [int(b) for b in os.environ.get("SIDE_BATCHES", "4,32,64,128,256").split(",") if b]
# (label, mode, distance): mode None = no prefetch.
VARIANTS = [("off", None, 0), ("bulk d=1", "bulk", 1), ("bulk d=2", "bulk", 2),
            ("load d=1", "load", 1)]  # fmt: skip


@triton.jit
def _row_kernel(x_ptr, out_ptr, stride_x, stride_out, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    row_op_body(x_ptr, out_ptr, stride_x, stride_out, N, MODE, BLOCK)


@triton.jit
def _bulk_prefetch_kernel(w_ptr, nbytes, CHUNK: tl.constexpr):
    prefetch_l2_share(w_ptr, nbytes, CHUNK)


@triton.jit
def _load_prefetch_kernel(w_ptr, sink_ptr, numel, BLOCK: tl.constexpr):
    # Program p reads its share of the weight with evict_last and writes one sum (so the loads
    # stay), leaving the lines in L2 for the projection that follows.
    n = tl.num_programs(0)
    share = tl.cdiv(tl.cdiv(numel, BLOCK), n) * BLOCK
    lo = tl.program_id(0).to(tl.int64) * share
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(lo, tl.minimum(lo + share, numel), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_last")
    tl.store(sink_ptr + tl.program_id(0), tl.sum(acc, 0))


def row_op(x, n, mode):
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _row_kernel[(x.shape[0],)](
        x, out, x.stride(0), out.stride(0), n, MODE=mode, BLOCK=triton.next_power_of_2(n),
        num_warps=4,
    )  # fmt: skip
    return out


def prefetch(w: torch.Tensor, mode: str, sink: torch.Tensor) -> None:
    if mode == "bulk":
        u8 = w.view(torch.uint8).view(-1)
        _bulk_prefetch_kernel[(16,)](u8, u8.numel(), CHUNK=1 << 16, num_warps=1)
    else:
        flat = w.view(-1)
        _load_prefetch_kernel[(sink.numel(),)](flat, sink, flat.numel(), BLOCK=2048, num_warps=8)


def floor_probe(dev) -> None:
    """One projection, N back-to-back calls per replay: the same weight (L2-resident after the
    first) against N distinct weights (DRAM each time)."""
    print("\nGEMM floor: us a call, same weight (L2) vs distinct weights (DRAM), 16 calls")
    shapes = {"qkv": (Q + 2 * H, H), "o": (H, Q), "gate_up": (2 * INTER, H), "down": (H, INTER)}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(16)]
        cells = []
        for m in (4, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            same = graph_median_us(lambda x=x, w=ws[0]: [x @ w.T for _ in range(16)], 20) / 16
            dist = graph_median_us(lambda x=x, ws=ws: [x @ w.T for w in ws], 20) / 16
            cells.append(f"M={m}: {same:5.1f} / {dist:5.1f}")
        mb = n * k * 2 / 2**20
        print(f"  {name:<8} {mb:5.1f} MB  " + "   ".join(cells))


def decode_chain(b, caches, splits, layers, gemms, side, sink):
    """forward(x, mode, dist): the 28 layers as a decode step runs them, with GEMM i+dist's
    weight prefetched on `side` just before GEMM i when mode is set."""

    def forward(x, mode, dist):
        main = torch.cuda.current_stream()
        forked = []

        def gemm(i, a):
            if mode is not None and i + dist < len(gemms):
                forked.append(i)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(gemms[i + dist], mode, sink)
            return a @ gemms[i].T

        for li in range(len(layers)):
            _, kc, vc, lens, tables = caches[li % len(caches)]
            h = row_op(x, H, 0)
            qkv = gemm(4 * li, h)
            qa = row_op(qkv, Q, 1).view(b, 16, 128)
            attn = launch_decode(qa, kc, vc, lens, tables, 128**-0.5, splits, 64, 4, 3)
            o = gemm(4 * li + 1, attn.view(b, Q))
            h = row_op(o, H, 0)
            gu = gemm(4 * li + 2, h)
            act = row_op(gu, INTER, 2)
            x = gemm(4 * li + 3, act)
        if forked:  # a join with no fork would tie the capture to uncaptured work
            main.wait_stream(side)
        return x

    return forward


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if os.environ.get("SIDE_FLOOR", "1") == "1":
        floor_probe(dev)
    layers = layer_weights(dev)
    gemms = [w[name] for w in layers for name in ("qkv", "o", "gu", "d")]  # launch order
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    sink = torch.empty(64, dtype=torch.float32, device=dev)
    gen = torch.Generator().manual_seed(0)
    print("\nDecode chain, us a layer (L2 flushed before each replay)")
    for b in BATCHES:
        t = round(1024 - 924 * b / 256)
        ctx = sorted((torch.randint(100, 1025, (b,), generator=gen) + t).tolist(), reverse=True)
        splits = choose_num_splits(b, HK, max(ctx), dev)
        # (q, k, v, lens, tables); one cache per layer while they fit in 16 GB, else reused
        # (a layer's K/V at those sizes is far past L2, so reuse gives no hits).
        per_layer = 2 * b * -(-max(ctx) // BS) * BS * HK * 128 * 2
        caches = [batch(ctx, BS) for _ in range(max(2, min(LAYERS, (16 << 30) // per_layer)))]
        forward = decode_chain(b, caches, splits, layers, gemms, side, sink)
        x0 = torch.randn(b, H, device=dev, dtype=torch.bfloat16)
        ref = forward(x0, None, 0)
        res = {}
        for label, mode, dist in VARIANTS:
            out = forward(x0, mode, dist)
            torch.cuda.synchronize()
            assert torch.equal(ref, out), f"{label} changed the result"
            res[label] = graph_median_us(
                lambda f=forward, x=x0, m=mode, d=dist: f(x, m, d), 20, before=flush.zero_
            )
        base = res["off"]
        cells = "  ".join(f"{k} {v / LAYERS:6.1f} ({v / base - 1:+.1%})" for k, v in res.items())
        kv_mb = 2 * sum(ctx) * HK * 128 * 2 / 2**20
        print(f"B={b:<4} splits {splits}, K/V {kv_mb:6.1f} MB a layer:  {cells}", flush=True)
        del caches, forward


if __name__ == "__main__":
    main()
