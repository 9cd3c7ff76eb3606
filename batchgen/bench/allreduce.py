"""`python -m batchgen.bench.allreduce`: NCCL against the one-shot all-reduce at decode sizes.

Starts one process per GPU (NCCL process group, as the engine does), checks the one-shot kernel
against NCCL (eagerly and in a replayed CUDA graph), then times both inside CUDA graphs for
[rows, hidden] activations and prints, per size, the microseconds of each and the threshold the
engine's start-up measurement (distributed/one_shot.py) would choose. --json writes the numbers.

    python -m batchgen.bench.allreduce --world-size 2 --hidden 8192 --json ar.json
"""

from __future__ import annotations

import argparse
import json
import queue as queues
import socket
import sys

import torch
import torch.multiprocessing as mp

from batchgen.distributed import one_shot
from batchgen.distributed.group import TensorParallel, make_store

DEFAULT_ROWS = "1,2,4,8,16,32,64,128,256,512"


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    device = torch.device("cuda", rank)
    store = make_store(rank, args.world_size, port)
    tp = TensorParallel.start(rank, args.world_size, device, store)
    try:
        report: dict = {"rank": rank, "device": torch.cuda.get_device_name(device)}
        why = one_shot.available()
        if why is not None:
            report["error"] = why
        else:
            dtype = getattr(torch, args.dtype)
            rows = [int(r) for r in args.rows.split(",")]
            # Room for the largest size, and for the check's fp32 sample of 4 rows.
            max_bytes = max(max(rows) * args.hidden * dtype.itemsize, 16 * args.hidden)
            kernel = one_shot.OneShotAllReduce(tp.group_name, max_bytes, device)
            sample = torch.empty(4, args.hidden, dtype=torch.float32, device=device)
            report["check"] = one_shot.check_correct(kernel, sample) or "ok"
            report["timings"] = one_shot.measure(kernel, args.hidden, rows, dtype, device)
        queue.put(report)
    finally:
        tp.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated row counts")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} GPUs, torch sees {torch.cuda.device_count()}")
        return 2
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    procs = mp.start_processes(
        _rank_main,
        args=(args, port, queue),
        nprocs=args.world_size,
        start_method="spawn",
        join=False,
    )
    reports = []
    while len(reports) < args.world_size:
        try:
            reports.append(queue.get(timeout=5))
        except queues.Empty:
            procs.join(timeout=0)  # raises if a rank failed
    procs.join()
    reports.sort(key=lambda r: r["rank"])
    errors = [r.get("error") or (r["check"] if r["check"] != "ok" else None) for r in reports]
    result: dict = {"world_size": args.world_size, "hidden": args.hidden, "dtype": args.dtype}
    result["device"] = reports[0]["device"]
    if any(errors):
        result["error"] = next(e for e in errors if e)
        print(f"one-shot all-reduce unusable: {result['error']}")
    else:
        # The slowest rank per size, as the engine decides.
        slowest = [
            (t[0][0], max(x[1] for x in t), max(x[2] for x in t))
            for t in zip(*(r["timings"] for r in reports))
        ]
        row_bytes = args.hidden * getattr(torch, args.dtype).itemsize
        result["timings_us"] = [
            {"rows": b // row_bytes, "bytes": b, "nccl": nccl, "one_shot": one}
            for b, nccl, one in slowest
        ]
        result["one_shot_max_bytes"] = one_shot.threshold(slowest)
        print(f"{'rows':>6} {'bytes':>10} {'NCCL us':>9} {'one-shot us':>12} {'speed-up':>9}")
        for t in result["timings_us"]:
            print(
                f"{t['rows']:>6} {t['bytes']:>10} {t['nccl']:>9.1f} {t['one_shot']:>12.1f} "
                f"{t['nccl'] / t['one_shot']:>8.2f}x"
            )
        print(f"one-shot up to {result['one_shot_max_bytes']} bytes (0: NCCL throughout)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
