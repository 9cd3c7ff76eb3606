"""Device ceilings measured in the same run: a large matmul (FLOP/s) and a device copy (B/s)."""

from __future__ import annotations

import statistics

import torch

from batchgen.bench.timing import synchronize, timed


def _median_time(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up (cuBLAS heuristics, allocation)
    return statistics.median(timed(fn, device)[0] for _ in range(iters))


def _matmul_s(n: int, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    return _median_time(lambda: torch.matmul(a, b), device, iters)


def _copy_s(nbytes: int, device: torch.device, iters: int) -> float:
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _median_time(lambda: dst.copy_(src), device, iters)


@torch.inference_mode()
def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """Matmul: bf16 8192^3 on GPU, 512^3 in the model dtype on CPU. Copy: 1 GiB on GPU, 64 MiB
    on CPU; its bandwidth counts bytes read + written.
    """
    gpu = device.type == "cuda"
    n = 8192 if gpu else 512
    mm_dtype = torch.bfloat16 if gpu else dtype
    t_mm = _matmul_s(n, mm_dtype, device, 10 if gpu else 5)
    nbytes = 2**30 if gpu else 64 * 2**20
    t_copy = _copy_s(nbytes, device, 20 if gpu else 5)
    synchronize(device)
    if gpu:
        torch.cuda.empty_cache()
    return {
        "matmul_shape": f"{n}x{n}x{n}",
        "matmul_dtype": str(mm_dtype).removeprefix("torch."),
        "matmul_tflops": 2.0 * n**3 / t_mm / 1e12,
        "copy_bytes": nbytes,
        "copy_tb_s": 2.0 * nbytes / t_copy / 1e12,
    }
