"""Registers, spills and shared memory of decode attention's split kernel per tile choice,
compiled for the H100 (sm_90a) on any machine: no GPU needed, only triton and its ptxas.

The kernel is compiled as the engine launches it (bf16, llama3.1-8b's heads: GROUP 4,
head_dim 128, 16-token pages; pointers and strides divisible by 16, which Triton's launcher
specializes on and which decides whether the K/V loads go through shared memory). An SM holds
65,536 registers and about 227 KB of shared memory, so programs per SM = the smaller of
65536 // (registers * 32 * warps) and 227 KB // shared.

Usage: PYTHONPATH=. python examples/benchmarks/kernel_resources.py [BLOCK_N,WARPS,STAGES ...]
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.decode_attention import _decode_split_kernel

ARGS = (
    ["q_ptr", "k_ptr", "v_ptr", "seq_lens_ptr", "block_tables_ptr", "out_ptr", "part_acc_ptr",
     "part_lse_ptr"],
    ["stride_qb", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
     "stride_vh", "stride_bt", "stride_ob", "stride_oh"],
)  # fmt: skip
TYPES = ["*bf16"] * 3 + ["*i32"] * 2 + ["*bf16"] + ["*fp32"] * 2 + ["i32"] * 11


def compile_tile(block_n: int, warps: int, stages: int) -> tuple[int, str]:
    """(shared bytes, ptxas's register / spill lines) for one tile choice."""
    names = ARGS[0] + ARGS[1]
    signature = dict(zip(names, TYPES)) | {"qk_scale": "fp32", "NUM_SPLITS": "i32"}
    constexprs = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=block_n, PAGE_SIZE=16,
        PRECISION="tf32", HEADS_FIRST=True, USE_PDL=True,
    )  # fmt: skip
    signature |= {name: "constexpr" for name in constexprs}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    src = ASTSource(_decode_split_kernel, signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run(
            [ptxas[0], "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines()]
    return kernel.metadata.shared, "; ".join(
        ln for ln in lines if "registers" in ln or "spill" in ln
    )


def main() -> None:
    tiles = [tuple(map(int, a.split(","))) for a in sys.argv[1:]] or [(64, 4, 3), (128, 4, 2)]
    for block_n, warps, stages in tiles:
        shared, regs = compile_tile(block_n, warps, stages)
        print(f"BLOCK_N {block_n:>3} warps {warps} stages {stages}: shared {shared:>6} B; {regs}")


if __name__ == "__main__":
    main()
