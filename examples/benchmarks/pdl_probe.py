"""Probe: programmatic dependent launch (PDL) across a decode step's small kernels. A CUDA
graph of 28 qwen3-0.6b-shaped layers (row op -> qkv, row op -> o, row op -> gate_up,
row op -> down), timed four ways:

- cublas:    Triton row kernels, cuBLAS projections (the engine today);
- triton:    the projections as a Triton GEMM too, launched normally;
- pdl:       every kernel launched with PDL: it may start while the kernel before it drains,
             waits (griddepcontrol.wait) before touching that kernel's outputs, and lets the
             next one launch right after;
- pdl+L2:    as pdl, and each GEMM program first asks L2 for its weight slice (one bulk
             prefetch, weights never depend on the kernel before), then waits;
- cublas+pdl: cuBLAS projections, the Triton row kernels launched with PDL (what the engine
             could do without a GEMM of its own).

Usage (CUDA machine, repo root): python examples/benchmarks/pdl_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from batchgen.bench.timing import graph_median_us

sys.path.insert(0, str(Path(__file__).parent))
from probe_chain import INTER, LAYERS, H, Q, layer_weights, row_op_body  # noqa: E402


@triton.jit
def _row_kernel(x_ptr, out_ptr, stride_x, stride_out, N, MODE: tl.constexpr,
                PDL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One row per program; MODE 0 = rms-like scale, 1 = copy, 2 = silu(gate) * up.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row_op_body(x_ptr, out_ptr, stride_x, stride_out, N, MODE, BLOCK)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): out tile [BLOCK_M, BLOCK_N] over all of K.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PREFETCH:
        # Rows n0..n0+BLOCK_N of w are one contiguous range when stride_w == K.
        if pid_m == 0:
            n0 = pid_n * BLOCK_N
            nbytes = (tl.minimum(BLOCK_N, N - n0) * K * 2).to(tl.int32)
            tl.inline_asm_elementwise(
                "{\n.reg .pred p;\n.reg .u32 t;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
                "=r,l,r",
                [w_ptr + n0.to(tl.int64) * stride_w, nbytes],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_tile, mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def row_op(x, n, mode, pdl):
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _row_kernel[(x.shape[0],)](
        x, out, x.stride(0), out.stride(0), n, MODE=mode, PDL=pdl,
        BLOCK=triton.next_power_of_2(n), num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def gemm(x, w, pdl, prefetch, tiles):
    block_m, block_n, block_k, warps, stages = tiles
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gemm_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), PDL=pdl, PREFETCH=prefetch,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        launch_pdl=pdl,
    )  # fmt: skip
    return out


def tiles_for(m: int, n: int) -> tuple[int, int, int, int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 16 if n <= 2048 else 32
    return block_m, block_n, 256, 4, 3


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf = torch.bfloat16
    layers = layer_weights(dev)

    def forward(x, mode):
        pdl = mode in ("pdl", "pdl+L2", "cublas+pdl")
        prefetch = mode == "pdl+L2"

        def proj(a, w):
            if mode.startswith("cublas"):
                return a @ w.T
            return gemm(a, w, pdl, prefetch, tiles_for(a.shape[0], w.shape[0]))

        for w in layers:
            h = row_op(x, H, 0, pdl)
            qkv = proj(h, w["qkv"])
            a = row_op(qkv, Q, 1, pdl)
            o = proj(a, w["o"])
            h = row_op(o, H, 0, pdl)
            gu = proj(h, w["gu"])
            act = row_op(gu, INTER, 2, pdl)
            x = proj(act, w["d"])
        return x

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    modes = ("cublas", "cublas+pdl", "triton", "pdl", "pdl+L2")
    for m in (4, 16, 32, 64, 128, 256):
        x = torch.randn(m, H, device=dev, dtype=bf)
        # One projection alone first: the Triton GEMM against cuBLAS (28 chained random layers
        # amplify rounding differences, so the whole-chain error below is only a sanity bound).
        w = layers[0]["gu"]
        one = gemm(x, w, False, False, tiles_for(m, w.shape[0])).float()
        one_ref = (x @ w.T).float()
        one_err = ((one - one_ref).abs().max() / one_ref.abs().max()).item()
        print(f"M={m:4d} one gate_up projection, Triton vs cuBLAS: max rel diff {one_err:.1e}")
        ref = forward(x, "cublas").float()
        base = forward(x, "triton")
        results = {}
        for mode in modes:
            out = forward(x, mode)
            torch.cuda.synchronize()
            if mode in ("pdl", "pdl+L2"):
                assert torch.equal(out, base), f"{mode} changed the Triton result"
            err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
            us = graph_median_us(lambda x=x, mode=mode: forward(x, mode), 20)
            results[mode] = (us / LAYERS, err)
        line = ", ".join(f"{k} {t:6.2f} us (err {e:.1e})" for k, (t, e) in results.items())
        print(f"M={m:4d} per layer: {line}", flush=True)


if __name__ == "__main__":
    main()
