"""Probe: does prefetching the next projection's weights into L2 (from the small Triton kernel
that runs before it) shorten cuBLAS decode GEMMs? A CUDA graph of 28 qwen3-0.6b-shaped layers
(norm -> qkv, copy -> o, norm -> gate_up, act -> down), timed with the prefetch off and on.

Usage (CUDA machine, repo root): python examples/benchmarks/l2_prefetch_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from batchgen.bench.timing import graph_median_us

sys.path.insert(0, str(Path(__file__).parent))
from probe_chain import (  # noqa: E402
    INTER,
    LAYERS,
    H,
    Q,
    layer_weights,
    prefetch_l2_share,
    row_op_body,
)

# (label, prefetch on, bytes per prefetch instruction)
VARIANTS = [("off", False, 1 << 16), ("on 64K", True, 1 << 16), ("on 1M", True, 1 << 20),
            ("on 16M", True, 1 << 24)]  # fmt: skip


@triton.jit
def _row_kernel(x_ptr, out_ptr, stride_x, stride_out, N, pf_ptr, pf_bytes,
                MODE: tl.constexpr, PREFETCH: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    # One row per program; MODE 0 = rms-like scale, 1 = copy, 2 = silu(gate) * up.
    if PREFETCH:
        prefetch_l2_share(pf_ptr, pf_bytes, CHUNK)
    row_op_body(x_ptr, out_ptr, stride_x, stride_out, N, MODE, BLOCK)


def row_op(x, n, mode, prefetch, chunk, weight):
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    pf = weight.view(torch.uint8)
    _row_kernel[(x.shape[0],)](
        x, out, x.stride(0), out.stride(0), n, pf, pf.numel(),
        MODE=mode, PREFETCH=prefetch, CHUNK=chunk, BLOCK=triton.next_power_of_2(n), num_warps=4,
    )  # fmt: skip
    return out


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    layers = layer_weights(dev)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)  # evicts L2 between replays

    def forward(x, prefetch, chunk):
        for w in layers:
            h = row_op(x, H, 0, prefetch, chunk, w["qkv"])
            qkv = h @ w["qkv"].T
            a = row_op(qkv, Q, 1, prefetch, chunk, w["o"])
            o = a @ w["o"].T
            h = row_op(o, H, 0, prefetch, chunk, w["gu"])
            gu = h @ w["gu"].T
            act = row_op(gu, INTER, 2, prefetch, chunk, w["d"])
            x = act @ w["d"].T
        return x

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for m in (4, 32, 64, 128, 256):
        x = torch.randn(m, H, device=dev, dtype=bf)
        results = {}
        ref = forward(x, False, 1 << 16)
        for label, prefetch, chunk in VARIANTS:
            out = forward(x, prefetch, chunk)
            torch.cuda.synchronize()
            assert torch.equal(ref, out), "prefetch changed the result"
            results[label] = graph_median_us(
                lambda x=x, p=prefetch, c=chunk: forward(x, p, c), 30, before=flush.zero_
            )
        base = results.pop("off")
        best_on = min(results.values())  # the prefetch variants only
        line = ", ".join(f"{k} {v:7.1f} us" for k, v in results.items())
        print(f"M={m:4d}: off {base:7.1f} us, {line}; per layer off {base / LAYERS:.2f} us, "
              f"best on {best_on / LAYERS:.2f} us")  # fmt: skip


if __name__ == "__main__":
    main()
