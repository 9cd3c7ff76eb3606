"""Would a cuBLAS GEMM in a CUDA graph wait (griddepcontrol.wait) behind a programmatic edge?

PDL (kernels.launch) reaches only the boundaries into our Triton kernels; the other four of a
decode layer's kernel boundaries lead into cuBLAS GEMMs. Making those graph edges programmatic
is safe only if the GEMM waits for the kernel before it. This probe captures
[a slow Triton writer of X, launched with PDL, that lets dependents launch at once] -> Y = X W^T
(torch's F.linear and our cuBLASLt binding), prints each kernel node's name and in-edge type,
then:
  - tries the stream attribute PROGRAMMATIC_STREAM_SERIALIZATION before capture;
  - rewrites the writer -> GEMM edge as a programmatic one (driver API) and replays: a GEMM
    that does not wait reads the zeros X held before the writer ran.

Usage (CUDA machine, repo root): PYTHONPATH=. python examples/benchmarks/cublas_pdl_probe.py
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from batchgen.kernels import cublaslt
from batchgen.kernels.launch import gdc_launch_dependents, gdc_wait, tl, triton

_cu = ctypes.CDLL("libcuda.so.1")
_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC / CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_STREAM_SERIALIZATION = 5  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


def node_name(node: int) -> str:
    kind = ctypes.c_int()
    _cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
    if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
        return f"<node type {kind.value}>"
    params = KernelParams()
    _cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params))
    name = ctypes.c_char_p()
    if params.func:
        _cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func))
    else:
        _cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern))
    return (name.value or b"?").decode()


def edges(graph: int) -> list[tuple[int, int, EdgeData]]:
    count = ctypes.c_size_t(0)
    get = _cu.cuGraphGetEdges_v2
    assert get(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)) == 0
    src = (ctypes.c_void_p * count.value)()
    dst = (ctypes.c_void_p * count.value)()
    data = (EdgeData * count.value)()
    assert get(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count)) == 0
    return [(src[i], dst[i], data[i]) for i in range(count.value)]


def show(graph: int, title: str) -> None:
    print(f"--- {title}")
    for src, dst, d in edges(graph):
        print(f"  {node_name(src)[:50]:50s} -> {node_name(dst)[:50]:50s} type {d.type}")


def make_programmatic(graph: int) -> None:
    """Every edge out of the writer becomes programmatic (the dependent may launch once all
    the writer's programs have called launch_dependents)."""
    for src, dst, d in edges(graph):
        if "slow_write" not in node_name(src):
            continue
        g, a, b = ctypes.c_void_p(graph), (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        assert _cu.cuGraphRemoveDependencies_v2(g, a, b, ctypes.byref(d), 1) == 0
        new = EdgeData(_PROGRAMMATIC, 0, _PROGRAMMATIC)
        assert _cu.cuGraphAddDependencies_v2(g, a, b, ctypes.byref(new), 1) == 0


@triton.jit
def slow_write(src, dst, n_src, n_dst, REPS: tl.constexpr, BLOCK: tl.constexpr):
    # Lets its dependents launch first thing, then reads src REPS times over (tens of us), then
    # writes ones into dst.
    gdc_wait()
    gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in range(REPS):
        offs = ((r * tl.num_programs(0) + pid) * BLOCK + tl.arange(0, BLOCK)) % n_src
        acc += tl.load(src + offs).to(tl.float32)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ones = 1.0 + acc * 0.0
    tl.store(dst + offs, ones.to(dst.dtype.element_ty), mask=offs < n_dst)


def main() -> None:
    m, k, n, block = 64, 4096, 4096, 1024
    dev = torch.device("cuda")
    src = torch.randn(256 << 20, device=dev, dtype=torch.bfloat16)
    x = torch.zeros(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
    ref = F.linear(torch.ones_like(x), w).float()

    def writer():
        grid = (triton.cdiv(m * k, block),)
        slow_write[grid](src, x, src.numel(), x.numel(), REPS=64, BLOCK=block, launch_pdl=True)

    product = cublaslt.LtProduct(m, n, k, torch.bfloat16, False, k, 0)
    algo = product.candidates(4)[0]
    gemms = {"F.linear": lambda: F.linear(x, w), "cuBLASLt": lambda: product(x, w, algo)}
    writer()
    for name, gemm in gemms.items():
        gemm()
        torch.cuda.synchronize()
        for mode in ("as captured", "stream attribute", "programmatic edge"):
            graph, stream = torch.cuda.CUDAGraph(keep_graph=True), torch.cuda.Stream()
            if mode == "stream attribute":
                value = (ctypes.c_byte * 64)(1)
                status = _cu.cuStreamSetAttribute(
                    ctypes.c_void_p(stream.cuda_stream), _STREAM_SERIALIZATION, value
                )
                print(f"cuStreamSetAttribute(PROGRAMMATIC_STREAM_SERIALIZATION): {status}")
            with torch.cuda.graph(graph, stream=stream):
                writer()
                y = gemm()
            if mode == "programmatic edge":
                make_programmatic(graph.raw_cuda_graph())
            show(graph.raw_cuda_graph(), f"{name}, {mode}")
            graph.instantiate()
            stale = 0
            for _ in range(5):
                x.zero_()
                torch.cuda.synchronize()
                graph.replay()
                torch.cuda.synchronize()
                stale += (y.float() - ref).abs().max().item() > 0.05
            print(f"  {name}, {mode}: {stale} of 5 replays read X before the writer's ones")


if __name__ == "__main__":
    main()
