"""Small targets for Nsight Compute: one kernel of the decode step, launched a few times on
engine-like inputs, so `ncu --launch-skip 2 --launch-count 1` reads the counters of a warm
launch (the gpu_session.sh stages ncu-decode and ncu-gemm run it that way).

Usage (CUDA machine, repo root):
    python examples/benchmarks/ncu_target.py attn B [--dump DIR]   # decode split kernel
    python examples/benchmarks/ncu_target.py gemm M K N            # F.linear, bf16

attn: qwen3-0.6b heads (16 q, 8 kv, head_dim 128), block size 16, the nano contexts at the
step where B sequences still run (decode_gap_probe's recipe), longest first, default splits.
--dump writes the split kernel's PTX, TTGIR and cubin (for cuobjdump -sass) to DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from batchgen.kernels.decode_attention import (
    _decode_split_kernel,
    choose_num_splits,
    paged_attention_decode,
)

sys.path.insert(0, str(Path(__file__).parent))
from decode_gap_probe import HK, batch  # noqa: E402

LAUNCHES = 4


def attn(b: int, dump: Path | None) -> None:
    gen = torch.Generator().manual_seed(0)
    t = round(1024 - 924 * b / 256)
    ctx = sorted((torch.randint(100, 1025, (b,), generator=gen) + t).tolist(), reverse=True)
    q, k_cache, v_cache, lens, tables = batch(ctx)
    splits = choose_num_splits(b, HK, max(ctx), q.device)
    for _ in range(LAUNCHES):
        paged_attention_decode(q, k_cache, v_cache, lens, tables, q.shape[-1] ** -0.5, splits)
    torch.cuda.synchronize()
    kv_bytes = 2 * sum(ctx) * HK * q.shape[-1] * 2
    print(f"attn B={b} splits={splits} contexts {min(ctx)}-{max(ctx)} K/V {kv_bytes / 1e6:.1f} MB")
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for cache in _decode_split_kernel.device_caches.values():
            for kernel in cache[0].values():
                for kind in ("ptx", "ttgir", "cubin"):
                    data = kernel.asm[kind]
                    path = dump / f"decode_split.{kind}"
                    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
                print(f"dumped to {dump}: regs {kernel.n_regs}, shared {kernel.metadata.shared}")


def gemm(m: int, k: int, n: int) -> None:
    # Unscaled normal values (no extra elementwise kernel to skip); the products stay finite.
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(LAUNCHES):
        F.linear(x, w)
    torch.cuda.synchronize()
    print(f"gemm M={m} K={k} N={n}: weight {n * k * 2 / 1e6:.1f} MB")


def main() -> None:
    what, *rest = sys.argv[1:]
    if what == "attn":
        dump = Path(rest[2]) if len(rest) > 2 and rest[1] == "--dump" else None
        attn(int(rest[0]), dump)
    elif what == "gemm":
        gemm(*(int(v) for v in rest[:3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
