"""The decoder projections' energy under sustained load, tuned (cuBLASLt algorithms picked by
`tune_gemms` from short timings) against cuBLAS's own pick: does a faster algorithm in a burst
stay faster, and cheaper in joules, at the power limit a llama3.1-8b nano run sits at?

Builds llama3.1-8b with random weights as the engine lays them out (K-major gate_up/down), tunes
the row counts below (from the cache when warm), then replays one CUDA graph of all 32 layers'
four projections back to back (energy_probe.measure: WARM s, then SECONDS timed) per row count,
tuned and untuned. Prints us a replay, W, SM MHz, mJ a replay and pJ per FLOP.

Usage (CUDA machine, repo root): python examples/benchmarks/gemm_energy_probe.py [M ...]
"""

from __future__ import annotations

import sys

import torch
from energy_probe import Nvml, measure

from batchgen.bench.random_model import build_random_model
from batchgen.layers import gemm_tuning, linear


def main() -> None:
    rows = [int(m) for m in sys.argv[1:]] or [64, 128, 192, 256, 320, 384]
    model, _ = build_random_model("llama3.1-8b", torch.bfloat16, torch.device("cuda"), seed=0)
    model.kn_weights_()
    groups = model.projection_groups()
    report = gemm_tuning.tune_projections(groups, rows)
    print(torch.cuda.get_device_name(), f"tuned {report.tuned} of {report.shapes} shapes")
    nvml = Nvml()
    bf = torch.bfloat16
    for m in rows:
        xs = [torch.randn(m, ws[0].shape[1], device="cuda", dtype=bf) for ws, _ in groups]
        outs = [torch.zeros(m, ws[0].shape[0], device="cuda", dtype=bf) for ws, _ in groups]
        flops = sum(2 * m * ws[0].numel() * len(ws) for ws, _ in groups)

        def step(xs=xs, outs=outs):
            for layer in range(len(groups[0][0])):
                for (ws, acc), x, out in zip(groups, xs, outs):
                    if acc:
                        linear.add_linear_(out, x, ws[layer])
                    else:
                        linear.linear(x, ws[layer])

        cells = []
        for name in ("tuned", "cuBLAS"):
            if name == "cuBLAS":
                linear.clear_tuning()
            us, watts, mhz, mj = measure(nvml, step)
            pj = mj * 1e9 / flops
            cells.append(f"{name} {us:6.0f} us {watts:4.0f} W {mhz} MHz {mj:6.1f} mJ {pj:.3f} pJ/F")
        gemm_tuning.tune_projections(groups, rows)  # registers the tuned algorithms again
        print(f"M={m:<4} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
