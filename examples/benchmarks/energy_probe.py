"""Energy of the kernels a llama3.1-8b `nano` step runs, against plain reads and a large matmul:
where the joules go on a GPU that runs the whole workload at its power limit.

A llama3.1-8b nano run holds the H100 at its 700 W cap (clock-event reason 0x4, SW power cap)
with the SM clock at 1,400-1,900 MHz, so its time is about its energy over 700 W. This probe
replays each workload's CUDA graph back to back for SECONDS (after WARM seconds to settle the
clock) and reads the board's energy counter (NVML, mJ) around the timed part. Prints per
workload: us a replay, mean W, SM MHz (sampled), mJ a replay, and pJ per byte of HBM traffic
(weights, K/V, or the copy's bytes) and per FLOP where those apply.

Usage (CUDA machine, repo root): python examples/benchmarks/energy_probe.py
"""

from __future__ import annotations

import ctypes
import time

import torch
import torch.nn.functional as F
from batchgen.kernels.decode_attention import _tiles as decode_tiles
from batchgen.kernels.decode_attention import launch_decode
from batchgen.kernels.paged_attention import paged_attention
from decode_tile_probe import HK, HQ, LAYERS, D, caches, chunk_args, nano_contexts

from batchgen.bench.timing import capture_graph

WARM, SECONDS = 1.0, 2.0


class Nvml:
    """The few NVML calls needed, through ctypes (no pynvml on the machine)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.handle = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) == 0

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        assert self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)) == 0
        return v.value

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        assert self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(v)) == 0
        return v.value


def measure(nvml: Nvml, fn) -> tuple[float, float, float, float]:
    """(us a replay, mean W, median sampled SM MHz, mJ a replay) of fn's graph run back to back."""
    return measure_graph(nvml, capture_graph(fn))


def measure_graph(nvml: Nvml, graph: torch.cuda.CUDAGraph) -> tuple[float, float, float, float]:
    """measure() of a captured graph (its nodes edited, say)."""
    torch.cuda.synchronize()
    end = time.perf_counter() + WARM
    while time.perf_counter() < end:
        graph.replay()
        torch.cuda.synchronize()
    clocks, n = [], 0
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    while time.perf_counter() - t0 < SECONDS:
        for _ in range(4):
            graph.replay()
        n += 4
        clocks.append(nvml.sm_mhz())
        torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), nvml.energy_mj()
    del graph
    return (
        (t1 - t0) / n * 1e6,
        (e1 - e0) / 1e3 / (t1 - t0),
        sorted(clocks)[len(clocks) // 2],
        (e1 - e0) / n,
    )


def workloads():
    """name -> (fn, HBM bytes a replay, FLOPs a replay)."""
    dev, bf = "cuda", torch.bfloat16
    out = {}
    src = torch.randn(2**29, device=dev, dtype=bf)  # 1 GiB
    dst = torch.empty_like(src)
    out["copy 1 GiB"] = (lambda: dst.copy_(src), 2 * src.nbytes, 0)
    out["read 1 GiB (sum)"] = (lambda: src.sum(), src.nbytes, 0)
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    b = torch.randn(8192, 8192, device=dev, dtype=bf)
    out["matmul 8192^3"] = (lambda: torch.matmul(a, b), 3 * a.nbytes, 2 * 8192**3)
    weights = [torch.randn(28672, 4096, device=dev, dtype=bf) for _ in range(8)]
    for m in (16, 128, 256, 384):
        x = torch.randn(m, 4096, device=dev, dtype=bf)
        out[f"gate_up M={m} x8"] = (
            lambda x=x: [F.linear(x, w) for w in weights],
            8 * weights[0].nbytes,
            8 * 2 * m * 4096 * 28672,
        )
    gen = torch.Generator().manual_seed(0)
    tiles = decode_tiles()
    for bsz in (64, 256):
        ctx = nano_contexts(bsz, gen)
        lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
        layers = [caches(ctx) for _ in range(LAYERS)]
        q = torch.randn(bsz, HQ, D, device=dev, dtype=bf)
        o = torch.empty_like(q)

        def decode(layers=layers, q=q, o=o, lens=lens):
            for k, v, tables in layers:
                launch_decode(q, k, v, lens, tables, D**-0.5, 1, *tiles, out=o)

        kv = LAYERS * 2 * sum(ctx) * HK * D * 2
        flops = LAYERS * 4 * sum(ctx) * HQ * D  # QK and PV of the real rows
        out[f"decode B={bsz} x{LAYERS}"] = (decode, kv, flops)
        if bsz == 64:
            chunks = [chunk_args(k, v, k.shape[0]) for k, v, _ in layers]
            co = torch.empty(128, HQ, D, device=dev, dtype=bf)
            out[f"chunk 128 at 472-599 x{LAYERS}"] = (
                lambda chunks=chunks, co=co: [paged_attention(*c, out=co) for c in chunks],
                LAYERS * 600 * HK * D * 2 * 2,
                LAYERS * 4 * 128 * 536 * HQ * D,
            )
    return out


def main() -> None:
    nvml = Nvml()
    print(torch.cuda.get_device_name(), f"warm {WARM} s, timed {SECONDS} s each")
    print("workload: us/replay, W, SM MHz, mJ/replay, pJ/byte, pJ/FLOP")
    for name, (fn, nbytes, flops) in workloads().items():
        us, watts, mhz, mj = measure(nvml, fn)
        pj_b = mj * 1e9 / nbytes if nbytes else float("nan")
        pj_f = mj * 1e9 / flops if flops else float("nan")
        print(
            f"{name:28s} {us:9.1f} us {watts:6.0f} W {mhz:5d} MHz {mj:8.2f} mJ "
            f"{pj_b:7.1f} pJ/B {pj_f:7.3f} pJ/FLOP  ({nbytes / us / 1e6:.2f} TB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
