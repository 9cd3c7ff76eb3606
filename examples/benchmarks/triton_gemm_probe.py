"""Can a plain Triton GEMM stream llama3.1-8b's decode weights faster than cuBLAS?

cuBLAS (nvjet persistent kernels) reads gate_up's 235 MB at 2.6-2.7 TB/s at M <= 128 and
2.2-2.4 TB/s at M = 256, against 2.9-3.0 TB/s for a copy (seventh and eighth sessions). This
times a tiled Triton kernel (a K split with fp32 partials where N alone gives too few
programs) over a small grid of tiles, against F.linear on the same weights. Each timed replay
cycles through copies of the weight (>= 256 MB) so the weight comes from HBM, as between the
layers of a real step (`gemm_shapes.time_linear`).

Usage (CUDA machine, repo root): python examples/benchmarks/triton_gemm_probe.py [tma]
`tma` times instead a variant whose weight tiles come through tensor descriptors (the bulk
tensor copy engine), pipelined 4 or 6 deep, on gate_up and down.
Prints, per projection and M: cuBLAS us and weight TB/s, the best Triton tiles, their us and
TB/s, and the largest relative error of that kernel against F.linear.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
BATCHES = (64, 128)  # below the ridge, where the read should run at the copy rate


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    # Grid (cdiv(N, BLOCK_N), SPLIT_K): out[:, n-tile] over one K range; all M rows in one
    # tile (M <= BLOCK_M), so each weight tile is read once. SPLIT_K > 1 writes fp32 partials.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT_K
    k0 = pid_k * k_len
    x_tile = x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_w + (k0 + ks)[None, :]
    row_ok = rows[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        x = tl.load(x_tile, mask=row_ok, other=0.0)  # [BLOCK_M, BLOCK_K], from L2
        w = tl.load(w_tile)  # [BLOCK_N, BLOCK_K], streamed from HBM
        acc = tl.dot(x, tl.trans(w), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = out_ptr + pid_k * stride_split + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemm_tma_kernel(
    x_ptr, w_desc, out_ptr, M, N, K, stride_x, stride_out, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    # As _gemm_kernel, but each weight tile comes through a tensor descriptor (the Hopper bulk
    # tensor copy engine), software-pipelined NUM_STAGES deep.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    k_len = K // SPLIT_K
    k0 = pid_k * k_len
    n0 = pid_n * BLOCK_N
    row_ok = rows[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + kk + ks)[None, :], mask=row_ok)
        w = w_desc.load([n0, k0 + kk])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + pid_k * stride_split + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _split_product(x, w, split, launch):
    """x @ w.T [M, N]: launch(part, block_m) writes it whole (split 1) or as split fp32
    partials [split, M, N], which are then summed into it."""
    m, n = x.shape[0], w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    launch(part, max(16, triton.next_power_of_2(m)))
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT_K=split, BLOCK=1024)
    return out


def gemm(x, w, block_n, block_k, split, warps, stages):
    (m, k), n = x.shape, w.shape[0]

    def launch(part, block_m):
        _gemm_kernel[(n // block_n, split)](
            x, w, part, m, n, k, x.stride(0), w.stride(0), n, m * n,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return _split_product(x, w, split, launch)


def gemm_tma(x, w, block_n, block_k, split, warps, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = x.shape, w.shape[0]
    desc = TensorDescriptor.from_tensor(w, [block_n, block_k])

    def launch(part, block_m):
        _gemm_tma_kernel[(n // block_n, split)](
            x, desc, part, m, n, k, x.stride(0), n, m * n,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
            NUM_STAGES=stages, num_warps=warps,
        )  # fmt: skip

    return _split_product(x, w, split, launch)


def hbm_weights(n: int, k: int) -> list[torch.Tensor]:
    """Copies of an [n, k] bf16 weight totalling >= 256 MB: cycled through, each call's weight
    comes from HBM, not the 50 MB L2."""
    copies = max(1, -(-(256 << 20) // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_us(fn, ws, rep: int = 50) -> float:
    """Microseconds of fn(w) per weight, in CUDA-graph replays of one call per copy in ws."""

    def run():
        for w in ws:
            fn(w)

    return do_bench_cudagraph(run, rep=rep) * 1e3 / len(ws)


def configs(m: int, n: int, k: int, tma: bool = False):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_m = max(16, triton.next_power_of_2(m))
    if tma:
        grid = itertools.product((64, 128, 256), (64, 128), (4,), (4, 6))
    else:
        grid = itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
    for block_n, block_k, warps, stages in grid:
        if tma and stages * (block_n + block_m) * block_k * 2 > 200 * 1024:
            continue  # the pipeline's buffers would not fit an SM's shared memory
        tiles = n // block_n
        for split in (1, 2, 4, 8):
            # Split K only where the N tiles alone leave SMs idle, up to about two waves.
            if split > 1 and (tiles >= sms or tiles * split > 2 * sms):
                continue
            if k % (split * block_k) == 0:
                yield block_n, block_k, split, warps, stages


def main() -> None:
    tma = sys.argv[1:] == ["tma"]
    kernel = gemm_tma if tma else gemm
    shapes = {k: SHAPES[k] for k in ("gate_up", "down")} if tma else SHAPES
    torch.manual_seed(0)
    print(f"{'proj':<8} {'M':>4} {'cuBLAS us':>9} {'TB/s':>5}  {'Triton us':>9} {'TB/s':>5} "
          f"{'rel err':>8}  tiles (block_n, block_k, split, warps, stages)")  # fmt: skip
    for name, (k, n) in shapes.items():
        ws = hbm_weights(n, k)
        nbytes = n * k * 2
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            base = time_us(lambda w, x=x: F.linear(x, w), ws)
            best = None
            for cfg in configs(m, n, k, tma):
                try:
                    out = kernel(x, ws[0], *cfg).float()
                    us = time_us(lambda w, x=x, cfg=cfg: kernel(x, w, *cfg), ws)
                except Exception as e:  # e.g. a tile needing more shared memory than an SM has
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                err = ((out - ref).norm() / ref.norm()).item()
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            us, cfg, err = best
            print(f"{name:<8} {m:>4} {base:>9.1f} {nbytes / base / 1e6:>5.2f}  {us:>9.1f} "
                  f"{nbytes / us / 1e6:>5.2f} {err:>8.1e}  {cfg}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
