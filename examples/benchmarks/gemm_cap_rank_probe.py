"""Does `tune_gemms` rank cuBLASLt's algorithms the way the power cap would? For llama3.1-8b's
four projections at a few row counts: the tuner's screening (gemm_tuning.screened: its
candidates, refinements and tile search), then its TUNE_KEEP fastest and cuBLAS, each replayed
back to back over all 32 layers' weights at the 700 W cap a nano run sits at
(energy_probe.measure), beside the burst timing the tuner chooses by.

If the algorithm that is fastest in a burst is not the one that takes least time (and energy)
at the cap, choosing by a sustained timing would be a lever; if the ranks agree, the tuner's
metric stands for the cap too. (gemm_energy_probe.py compared only the tuner's pick with cuBLAS.)

Prints, per projection and row count, one line per algorithm: burst us (CUDA-graph replays over
all layers, the tuner's confirm timing), sustained us, W, SM MHz and mJ a replay; `*` marks the
tuner's pick (cuBLAS where no candidate beats it by TUNE_MIN_GAIN).

Usage (CUDA machine, repo root): python examples/benchmarks/gemm_cap_rank_probe.py [M ...]
"""

from __future__ import annotations

import sys

import energy_probe
import torch
import torch.nn.functional as F
from batchgen.kernels.cublaslt import LtProduct
from energy_probe import Nvml, measure

from batchgen.bench.random_model import build_random_model
from batchgen.bench.timing import graph_median_us
from batchgen.layers import gemm_tuning, linear

TUNE_KEEP = 4
NAMES = ("qkv", "o", "gate_up", "down")  # projection_groups' order
energy_probe.WARM, energy_probe.SECONDS = 0.7, 1.0


@torch.inference_mode()
def main() -> None:
    rows = [int(m) for m in sys.argv[1:]] or [64, 128, 192, 256, 384]
    model, _ = build_random_model("llama3.1-8b", torch.bfloat16, torch.device("cuda"), seed=0)
    model.fold_norms_()  # as the engine lays the model out: o and down add into the residual
    model.kn_weights_()
    linear.clear_tuning()
    nvml = Nvml()
    print(torch.cuda.get_device_name(), f"keep {TUNE_KEEP}; warm 0.7 s, timed 1.0 s each")
    for name, (weights, accumulate) in zip(NAMES, model.projection_groups()):
        w0 = weights[0]
        n, k = w0.shape
        kn = linear.weight_kn(w0)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=w0.dtype)
            out = torch.zeros(m, n, device="cuda", dtype=w0.dtype)
            product = LtProduct(m, n, k, w0.dtype, kn, k, w0.device.index, accumulate)
            kept = gemm_tuning.screened(weights, m, product, x, out)[:TUNE_KEEP]

            def cublas_step(x=x, out=out, ws=weights, acc=accumulate):
                for w in ws:
                    out.addmm_(x, w.t()) if acc else F.linear(x, w)

            def lt_step(cand, x=x, out=out, ws=weights, product=product):
                for w in ws:
                    product(x, w, cand, out=out)

            rows_out = [("cuBLAS", cublas_step)]
            rows_out += [(f"lt#{i}", lambda c=c: lt_step(c)) for _, i, c in kept]
            # Burst: the median of CONFIRM_REPLAYS graph replays of all layers, as the tuner
            # confirms its finalists.
            burst = {
                label: graph_median_us(step, gemm_tuning.CONFIRM_REPLAYS)
                for label, step in rows_out
            }
            configs = {f"lt#{i}": str(c.config()) for _, i, c in kept}
            finalists = [f"lt#{i}" for _, i, _ in kept[: gemm_tuning.TUNE_CONFIRM]]
            best = min(finalists, key=lambda s: burst[s], default=None)
            gain = gemm_tuning.TUNE_MIN_GAIN
            pick = best if best and burst[best] < burst["cuBLAS"] * (1 - gain) else "cuBLAS"
            print(f"{name} M={m}", flush=True)
            for label, step in rows_out:
                us, watts, mhz, mj = measure(nvml, step)
                mark = "*" if label == pick else " "
                print(
                    f"  {mark}{label:8s} burst {burst[label]:8.1f} us | cap {us:8.1f} us "
                    f"{watts:4.0f} W {mhz:5d} MHz {mj:7.2f} mJ  {configs.get(label, '')}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
