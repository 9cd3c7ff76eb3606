"""Near the roofline ridge (M = 192 .. 384 rows), can a Triton GEMM beat cuBLAS on llama3.1-8b's
projections?

A mixed step (decode rows + a prompt chunk) runs the projections at M = B + P rows. There the
cuBLAS kernels run at about 2.0 TB/s of weights at M=256 and 57% of 775 TFLOP/s at M=384
(`gemm_shapes.py curve`), where max(weight read, compute) would allow about 5 ms and 7 ms a
step. This times, per projection and M:
- cuBLAS through F.linear, as the engine calls it; again with cuBLASLt preferred, and with
  bf16 reduced-precision reductions off (either may change cuBLAS's kernel choice);
- a tiled Triton kernel whose x and weight tiles come through tensor descriptors, with the
  M tiles of one N tile in consecutive programs (so they share the weight tile in L2), over a
  small grid of tiles, plain (one program a tile) and persistent (one program an SM); on
  request (RIDGE_VARIANTS) each also warp-specialized (`tl.range(..., warp_specialize=True)`:
  a producer partition issues the loads while the default warps run the MMAs). With triton
  3.6 those compile for sm_90a (128 x 128 tiles: 12 warps, setmaxnreg), but on the H100 the
  128 x 128 ones never return and the 64 x 128 ones take about 2x cuBLAS's time
  (ws_gemm_check.py; RESULTS.md, twentieth session). Run them under a timeout.
Each timed replay cycles through copies of the weight (>= 256 MB), so weights come from HBM.

Usage (CUDA machine, repo root): python examples/benchmarks/ridge_gemm_probe.py [M ...]
Prints per projection and M: us and TFLOP/s for each cuBLAS setting and the best Triton tiles,
and the Triton result's largest relative error against F.linear.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton_gemm_probe
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
BATCHES = (192, 256, 320, 384)
# RIDGE_VARIANTS=tiled-ws,persistent-ws and RIDGE_SHAPES=gate_up,down narrow a run.
VARIANTS = os.environ.get("RIDGE_VARIANTS", "tiled,persistent").split(",")
SHAPES = {k: SHAPES[k] for k in os.environ.get("RIDGE_SHAPES", ",".join(SHAPES)).split(",")}


@triton.jit
def _acc_tile(x_desc, w_desc, K, pid_m, pid_n,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    # x[m-tile, :] @ w[n-tile, :].T, fp32 [BLOCK_M, BLOCK_N]. WS: the K loop warp-specialized
    # (a producer partition issues the descriptor loads while the default warps run the MMAs).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WS):
        x = x_desc.load([pid_m * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([pid_n * BLOCK_N, k])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _store_tile(out_ptr, acc, M, stride_out, pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] < M)


@triton.jit
def _mm_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_out,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    # One program a tile; the M tiles of an N tile are consecutive program ids.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    acc = _acc_tile(x_desc, w_desc, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, WS)
    _store_tile(out_ptr, acc, M, stride_out, pid_m, pid_n, BLOCK_M, BLOCK_N)


@triton.jit
def _mm_persistent_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_out,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_STAGES: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    # One program an SM, striding over the tiles in the same order. WS: the tile loop is
    # warp-specialized (the next tile's loads overlap this tile's MMAs and store), its K loop
    # a plain one.
    num_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_m * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), warp_specialize=WS):
        pid_m, pid_n = tile % num_m, tile // num_m
        if WS:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k])
                w = w_desc.load([pid_n * BLOCK_N, k])
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = _acc_tile(x_desc, w_desc, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                            NUM_STAGES, False)  # fmt: skip
        _store_tile(out_ptr, acc, M, stride_out, pid_m, pid_n, BLOCK_M, BLOCK_N)


KERNELS = {  # variant: (kernel, persistent, warp-specialized)
    "tiled": (_mm_kernel, False, False),
    "persistent": (_mm_persistent_kernel, True, False),
    "tiled-ws": (_mm_kernel, False, True),
    "persistent-ws": (_mm_persistent_kernel, True, True),
}


def gemm(x, w, cfg, variant):
    block_m, block_n, block_k, warps, stages = cfg
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel, persistent, ws = KERNELS[variant]
    kernel[(min(tiles, sms) if persistent else tiles,)](
        x_desc, w_desc, out, m, n, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, WS=ws,
        num_warps=warps,
    )  # fmt: skip
    return out


def configs():
    # RIDGE_CONFIGS="128,128,64,4,4;64,128,64,4,4" (block m, n, k, warps, stages) narrows the grid.
    if os.environ.get("RIDGE_CONFIGS"):
        yield from (tuple(map(int, c.split(","))) for c in os.environ["RIDGE_CONFIGS"].split(";"))
        return
    for block_m, block_n, warps, stages in itertools.product((64, 128), (128, 256), (4, 8), (3, 4)):
        if stages * (block_m + block_n) * 64 * 2 > 220 * 1024:
            continue  # the pipeline's buffers would not fit an SM's shared memory
        if block_m * block_n > 128 * 128 and warps == 4:
            continue  # too many accumulator registers for one warpgroup
        yield block_m, block_n, 64, warps, stages


def time_us(fn, ws) -> float:
    return triton_gemm_probe.time_us(fn, ws, rep=40)


def cublas_us(x, ws) -> dict[str, float]:
    cuda = torch.backends.cuda
    out = {"cuBLAS": time_us(lambda w: F.linear(x, w), ws)}
    cuda.preferred_blas_library("cublaslt")
    out["cuBLASLt"] = time_us(lambda w: F.linear(x, w), ws)
    cuda.preferred_blas_library("cublas")
    cuda.matmul.allow_bf16_reduced_precision_reduction = False
    out["no-reduced"] = time_us(lambda w: F.linear(x, w), ws)
    cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return out


def main() -> None:
    batches = [int(a) for a in sys.argv[1:]] or BATCHES
    torch.manual_seed(0)
    # Descriptors of the weights are made per call; the weights rotate to come from HBM.
    for name, (k, n) in SHAPES.items():
        ws = triton_gemm_probe.hbm_weights(n, k)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0]).float()
            flop = 2 * m * n * k
            cells = [
                f"{t}: {us:6.1f} us {flop / us / 1e6:4.0f} TF" for t, us in cublas_us(x, ws).items()
            ]
            for variant in VARIANTS:
                best = None
                for cfg in configs():
                    try:
                        out = gemm(x, ws[0], cfg, variant).float()
                        us = time_us(lambda w, x=x, cfg=cfg, v=variant: gemm(x, w, cfg, v), ws)
                    except Exception as e:  # e.g. out of shared memory or registers
                        print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                        continue
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    if best is None or us < best[0]:
                        best = (us, cfg, err)
                if best is None:
                    cells.append(f"{variant}: no config ran")
                    continue
                us, cfg, err = best
                tflops = flop / us / 1e6
                cells.append(f"{variant} {cfg}: {us:6.1f} us {tflops:4.0f} TF err {err:.0e}")
            print(f"{name:<8} M={m:<4}\n    " + "\n    ".join(cells), flush=True)


if __name__ == "__main__":
    main()
