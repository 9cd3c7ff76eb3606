"""The top-k / top-p / min-p sampling kernel alone: us a call by rows, filter, logit shape and
the kernel's launch options (CONFIGS).

Usage (CUDA machine, repo root): python examples/benchmarks/top_k_top_p_probe.py [VOCAB]
(default 128,256, llama3's vocabulary). Logits are bf16 randn x scale / 0.6: scale 1 is flat
(as the random-weight models give, so most of the vocabulary is in a 0.9 nucleus), scale 4 is
peaked. Each graph replays 8 launches with 8 different steps (so 8 noise draws, whose
rejections differ), timed as a CUDA graph; us are per launch. The plain Gumbel-max kernel
(`ops.sample_gumbel`, no filter) is the line to compare with.
"""

from __future__ import annotations

import sys

import torch
from batchgen.kernels import ops
from batchgen.kernels.top_k_top_p import launch_top_k_top_p

from batchgen.bench.timing import graph_median_us

FILTERS = {
    "top-p 0.9": {"top_p": 0.9},
    "top-k 50 + top-p 0.95": {"top_k": 50, "top_p": 0.95},
    "top-k 50": {"top_k": 50},
    "min-p 0.05": {"min_p": 0.05},
}
# Launch options against the defaults (listed first): elements a loop step and warps, top-k's
# radix digit bits, and its walk from the lanes' bound (0: the radix select alone).
CONFIGS = {
    "default": {},
    "radix only": {"top_k_walk": 0},
    "walk 1": {"top_k_walk": 1},
    "radix 8 bits": {"radix_bits": 8},
    "2048 x 8 warps": {"block": 2048, "num_warps": 8},
}
DRAWS = 8


def per_row(rows: int, values: dict) -> dict:
    """{filter name: [rows] tensor on the GPU} for one filter set."""
    out = {}
    for name, value in values.items():
        dtype = torch.int32 if name == "top_k" else torch.float32
        out[name] = torch.full((rows,), value, dtype=dtype, device="cuda")
    return out


def per_launch_us(launch, steps: list[torch.Tensor]) -> float:
    """us a launch: launch(steps) for each of the steps tensors, in one CUDA graph."""
    return graph_median_us(lambda: [launch(st) for st in steps], 9) / len(steps)


def row_line(scale: float, rows: int, vocab: int, g: torch.Generator) -> str:
    """One printed line: the plain kernel, then each filter at each tile."""
    logits = (scale * torch.randn(rows, vocab, device="cuda", generator=g)).bfloat16()
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
    steps = [torch.full((rows,), s, device="cuda", dtype=torch.int64) for s in range(DRAWS)]
    temps = torch.full((rows,), 0.6, device="cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    plain = per_launch_us(lambda st: ops.sample_gumbel(logits, seeds, st, temps), steps)
    line = f"x{scale:.0f} {rows:3d} rows | plain {plain:6.0f}"
    for name, values in FILTERS.items():
        f = per_row(rows, values)
        filters = (f.get("top_k"), f.get("top_p"), f.get("min_p"))
        cells = [
            per_launch_us(
                lambda st, c=config, fs=filters: launch_top_k_top_p(
                    logits, seeds, st, temps, *fs, out, **c
                ),
                steps,
            )
            for config in CONFIGS.values()
        ]
        line += f" | {name} " + " / ".join(f"{c:6.0f}" for c in cells)
    return line


def main() -> None:
    vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 128_256
    g = torch.Generator(device="cuda").manual_seed(0)
    for scale in (1.0, 4.0):
        for rows in (1, 16, 64, 256):
            print(row_line(scale, rows, vocab, g), flush=True)
    print("us a launch; filtered cells: " + " / ".join(CONFIGS))


if __name__ == "__main__":
    main()
