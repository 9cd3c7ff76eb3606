"""Which Triton kernels compile during a timed run (after the benchmark's warm-up)?

Each compile costs about a second and lands in the timed region on a machine whose Triton
cache is cold. Runs the `nano` warm-up and then the workload with an empty cache directory and
lists the kernel variants first built during the workload, with their specialization.

Usage (CUDA machine, repo root): python examples/benchmarks/jit_misses.py [PRESET] [WARMUP]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(tempfile.mkdtemp(prefix="triton-cache-"))
os.environ["TRITON_CACHE_DIR"] = str(CACHE)  # before Triton is imported

from nano_engine import nano_bench  # noqa: E402

from batchgen.bench.engine_run import drain, submit  # noqa: E402
from batchgen.bench.workloads import warmup_workload  # noqa: E402


def compiled() -> dict[str, dict]:
    """Cache entry -> its metadata (one entry per compiled kernel variant)."""
    out = {}
    for meta in CACHE.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            out[str(meta.parent.name)] = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
    return out


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    bench, w, vocab = nano_bench(preset)
    engine = bench.engine()
    submit(engine, warmup_workload(w, vocab, warmup), "warmup-")
    drain(engine)
    before = compiled()
    t0 = time.perf_counter()
    submit(engine, w, "")
    drain(engine)
    print(f"{preset}: {len(before)} variants built before the timed run (start-up, warm-up)")
    print(f"timed run {time.perf_counter() - t0:.2f} s; variants first built during it:")
    for key, meta in compiled().items():
        if key not in before:
            name = meta.get("name", "?")
            spec = {k: meta[k] for k in ("constants", "attrs", "signature") if k in meta}
            print(f"  {name}: {json.dumps(spec)[:400]}")


if __name__ == "__main__":
    main()
