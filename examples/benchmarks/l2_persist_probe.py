"""Probe: do llama3.1-8b's MLP activations cost DRAM traffic that L2 could keep on chip?

A decode step's gate_up output ([M, 28672] bf16, 22 MB at 384 rows) is written by the GEMM and
read back by SiLU-and-mul; between the two the GEMM streams 235 MB of weights through L2, so
most of it goes out to DRAM and comes back. An L2 access-policy window (a launch attribute of
the stream, which CUDA-graph capture copies into each kernel node) can mark a buffer's lines
persisting: they stay in the part of L2 set aside for persisting accesses (31 MB of the H100's
50) while the weights stream past. On the MLP alone that pays from 128 rows on; built into the
engine (an MLP arena under such windows, twenty-eighth session) every form tried made
llama3.1-8b nano slower, because the rest of the step needs the L2 the set-aside takes
(RESULTS.md). It is not in the engine.

The graph is 32 layers of: gate_up (torch.mm into the arena) -> SiLU-and-mul (into the arena,
the RMSNorm row scale folded in as in the engine) -> down (residual += act @ W^T), weights
K-major as the engine keeps them on CUDA. Per row count M, replayed back to back at the board's
power limit (energy_probe.measure_graph):
  base     as captured;
  pinned   every kernel node gets a persisting window over the whole arena (gate_up output
           and SiLU output), so they stay pinned in L2 for the whole graph;
  scoped   gate_up's writes persist, SiLU's reads turn them back to normal (nothing stays
           pinned past the MLP);
  no-silu  down reads the gate columns directly: what SiLU-and-mul costs at most.
Prints us, W, SM MHz and mJ a replay. Usage (CUDA machine, repo root, PYTHONPATH=. plus
examples/benchmarks): python examples/benchmarks/l2_persist_probe.py [M ...]
"""

from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager, nullcontext

import torch
from batchgen.kernels.ops import silu_and_mul
from energy_probe import Nvml, measure_graph

from batchgen.bench.timing import capture_graph

HIDDEN, INTER, LAYERS = 4096, 14336, 32
_cu = ctypes.CDLL("libcuda.so.1")
_LIMIT_PERSISTING_L2 = 0x06  # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_PERSISTING_L2 = 108  # CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE
_ACCESS_POLICY_WINDOW = 1  # CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW (stream and kernel node)
_NORMAL, _STREAMING, _PERSISTING = 0, 1, 2  # CUaccessProperty


class AccessPolicyWindow(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hit_ratio", ctypes.c_float),
        ("hit_prop", ctypes.c_int),
        ("miss_prop", ctypes.c_int),
    ]


class AttrValue(ctypes.Union):  # CUlaunchAttributeValue (a 64-byte union)
    _fields_ = [("window", AccessPolicyWindow), ("pad", ctypes.c_byte * 64)]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: CUresult {status}")


@contextmanager
def scope(part: torch.Tensor, prop: int, set_aside: int):
    """Kernels launched (or captured) on the current stream inside the block access part with
    property prop (hit ratio: the set-aside over part's size, at most 1)."""
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    value = AttrValue()
    value.window = AccessPolicyWindow(
        part.data_ptr(), part.nbytes, min(1.0, set_aside / part.nbytes), prop, _STREAMING
    )
    _check(_cu.cuStreamSetAttribute(stream, _ACCESS_POLICY_WINDOW, ctypes.byref(value)), "set")
    try:
        yield
    finally:
        value.window = AccessPolicyWindow(0, 0, 0.0, _NORMAL, _NORMAL)
        _check(
            _cu.cuStreamSetAttribute(stream, _ACCESS_POLICY_WINDOW, ctypes.byref(value)), "unset"
        )


def window_bytes(graph: int) -> list[int]:
    """The access-policy window's bytes of each kernel node of graph (a cudaGraph_t)."""
    count = ctypes.c_size_t(0)
    _check(_cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "nodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(_cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "nodes")
    out = []
    for node in nodes:
        kind, value = ctypes.c_int(), AttrValue()
        _check(_cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "type")
        if kind.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            _check(_cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), _ACCESS_POLICY_WINDOW,
                                                     ctypes.byref(value)), "attr")  # fmt: skip
            out.append(value.window.num_bytes)
    return out


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [64, 128, 256, 384]
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.zeros(1, device=dev)  # the context the limit applies to
    most = ctypes.c_int()
    _check(_cu.cuDeviceGetAttribute(ctypes.byref(most), _ATTR_MAX_PERSISTING_L2, 0), "attribute")
    # K-major weights, as the engine keeps gate_up and down on CUDA: [N, K] views of [K, N].
    # Scaled so activations stay near 1 over many replays (no overflow; realistic bit traffic).
    gate_up = [torch.randn(HIDDEN, 2 * INTER, device=dev, dtype=bf).t() / 64 for _ in range(LAYERS)]
    down = [torch.randn(INTER, HIDDEN, device=dev, dtype=bf).t() / 64 for _ in range(LAYERS)]
    nvml = Nvml()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    name = torch.cuda.get_device_name()
    print(f"{name}: L2 {l2 >> 20} MiB, persisting set-aside at most {most.value >> 20} MiB")
    print("M, variant: us a replay, W, SM MHz, mJ a replay")
    for m in rows:
        arena = torch.empty(m * 3 * INTER, device=dev, dtype=bf)
        set_aside = min(most.value, arena.nbytes)
        _check(_cu.cuCtxSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(set_aside)), "limit")
        print(f"M={m}: arena {arena.nbytes / 2**20:.1f} MiB, set-aside {set_aside / 2**20:.1f} MiB")
        probe_rows(m, arena, set_aside, gate_up, down, nvml)


def probe_rows(m: int, arena: torch.Tensor, set_aside: int, gate_up: list, down: list,
               nvml: Nvml) -> None:  # fmt: skip
    """The variants at m rows, each captured and measured at the power limit."""
    hidden = torch.randn(m, HIDDEN, device=arena.device, dtype=arena.dtype)
    gu = arena[: m * 2 * INTER].view(m, 2 * INTER)
    act = arena[m * 2 * INTER :].view(m, INTER)

    def mlp(variant: str) -> None:
        pinned, scoped = variant == "pinned", variant == "scoped"
        with scope(arena, _PERSISTING, set_aside) if pinned else nullcontext():
            for wgu, wd in zip(gate_up, down):
                with scope(gu, _PERSISTING, set_aside) if scoped else nullcontext():
                    torch.mm(hidden, wgu.t(), out=gu)
                with scope(gu, _NORMAL, set_aside) if scoped else nullcontext():
                    if variant == "no-silu":
                        a = gu[:, :INTER]
                    else:
                        a = silu_and_mul(gu, hidden, 1e-5, out=act)
                hidden.addmm_(a, wd.t())

    for variant in ("base", "pinned", "scoped", "no-silu", "scoped", "pinned", "base"):
        graph = capture_graph(lambda v=variant: mlp(v), keep_graph=True)
        spans = window_bytes(graph.raw_cuda_graph())
        graph.instantiate()
        us, watts, mhz, mj = measure_graph(nvml, graph)
        print(
            f"M={m:4d} {variant:8s} {us:9.1f} us {watts:5.0f} W {mhz:5d} MHz {mj:8.1f} mJ "
            f"({sum(b > 0 for b in spans)} of {len(spans)} kernel nodes with a window)",
            flush=True,
        )
        del graph
        _check(_cu.cuCtxResetPersistingL2Cache(), "reset")  # nothing pinned for the next one


if __name__ == "__main__":
    main()
