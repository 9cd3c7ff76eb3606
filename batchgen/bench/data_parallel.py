"""`batchgen bench --data-parallel-size N`: N engines in N processes, one per GPU group, timed
together; the report is the total output tok/s and each GPU's.

Each process (spawned, pinned to its GPUs with CUDA_VISIBLE_DEVICES) runs the ordinary bench
session: ceilings, model, warm-up, then waits at a barrier so that every timed run starts at
the same moment. Load `full`: every GPU runs the whole workload (N x its requests in all, the
data parallel scaling test); `split`: GPU i runs requests i, i + N, ... of one workload (the
fixed workload's speed-up). The total is the output tokens of all GPUs over the longest wall
time: the job is done when its last GPU is.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import statistics
import traceback
from collections.abc import Callable
from typing import Any

from batchgen.bench.session import BenchOptions, run_bench
from batchgen.pipeline.dp_placement import Placement, cuda_visible, visible_gpus

LOADS = ("full", "split")
BARRIER_TIMEOUT_S = 1800.0  # a peer still building its model (large presets) after this: broken
POLL_S = 0.5


class DataParallelBenchError(RuntimeError):
    """A process failed (its message), or more GPUs were asked for than visible."""


def gpu_groups(size: int, tensor_parallel: int, device: str) -> list[tuple[str, ...]]:
    """Each process's CUDA_VISIBLE_DEVICES entries (empty tuples on CPU)."""
    gpus = visible_gpus()
    if device == "cpu" or (device == "auto" and not gpus):
        return [()] * size
    first = int(device.split(":")[1]) if ":" in device else 0
    need = size * tensor_parallel
    if first + need > len(gpus):
        raise DataParallelBenchError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel} needs {need} "
            f"GPUs from cuda:{first} on, but {len(gpus)} are visible"
        )
    t = tensor_parallel
    return [tuple(gpus[first + i * t : first + (i + 1) * t]) for i in range(size)]


def run_data_parallel(
    opts: BenchOptions, size: int, load: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """Run the bench in `size` processes; the combined report (bench.report's keys where they
    apply, each process's own report under `workers`)."""
    groups = gpu_groups(size, opts.engine.tensor_parallel_size, opts.engine.device)
    context = multiprocessing.get_context("spawn")
    barrier, inbox = context.Barrier(size), context.Queue()
    procs = []
    for i, gpus in enumerate(groups):
        engine = opts.engine
        if gpus and engine.device.startswith("cuda"):
            engine = dataclasses.replace(engine, device="cuda")  # its first visible GPU
        mine = dataclasses.replace(opts, engine=engine, part=(i, size) if load == "split" else None)
        proc = context.Process(target=_worker, args=(i, mine, barrier, inbox), name=f"bench-dp-{i}")
        with cuda_visible(gpus):
            proc.start()
        procs.append(proc)
    reports: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    try:
        while len(reports) + len(errors) < size:
            try:
                kind, i, body = inbox.get(timeout=POLL_S)
            except queue.Empty:
                for i, p in enumerate(procs):  # died without a word (killed, out of memory)
                    if p.exitcode not in (None, 0) and i not in reports and i not in errors:
                        barrier.abort()  # the others stop waiting for it
                        errors[i] = f"process {i} exited with {p.exitcode}"
                continue
            if kind == "log":
                log(f"[dp {i}] {body}")
            elif kind == "report":
                reports[i] = body
            else:
                barrier.abort()
                errors[i] = f"process {i}: {body}"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        raise DataParallelBenchError("; ".join(errors[i] for i in sorted(errors)))
    return combine([reports[i] for i in range(size)], groups, load)


def combine(
    reports: list[dict[str, Any]], groups: list[tuple[str, ...]], load: str
) -> dict[str, Any]:
    """The processes' reports as one: per timed run, all output tokens over the longest wall
    time; the median of those runs; each GPU's own output tok/s."""
    runs = []
    for parts in zip(*(r["runs"] for r in reports)):
        tokens, wall = sum(p["output_tokens"] for p in parts), max(p["wall_s"] for p in parts)
        runs.append({"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall})
    median = statistics.median_low(r["output_tok_s"] for r in runs)
    result = dict(next(r for r in runs if r["output_tok_s"] == median))
    per_gpu = [r["result"]["output_tok_s"] for r in reports]
    result.update(
        requests=sum(r["workload"]["num_requests"] for r in reports),
        per_gpu_output_tok_s=per_gpu,
        output_tok_s_per_gpu=result["output_tok_s"] / len(reports),
    )
    first = reports[0]
    return {
        "data_parallel_size": len(reports),
        "load": load,
        "devices": [Placement(i, g).label for i, g in enumerate(groups)],
        "device": first["device"],
        "git_commit": first.get("git_commit"),
        "workload": first["workload"]["name"],
        "model": first["model"]["name"],
        "repeat": first["repeat"],
        "runs": runs,
        "result": result,
        "workers": reports,
    }


def format_table(report: dict[str, Any]) -> str:
    r = report["result"]
    lines = [
        f"{report['workload']} | {report['model']} | data parallel {report['data_parallel_size']} "
        f"({report['load']} load) | {report['device']} | median of {report['repeat']} | "
        f"commit {str(report['git_commit'])[:10]}",
        f"output tok/s (total)  {r['output_tok_s']:.1f}",
        f"output tok/s per GPU  {r['output_tok_s_per_gpu']:.1f}",
        f"requests              {r['requests']}",
        f"output tokens         {r['output_tokens']}",
        f"wall s (slowest GPU)  {r['wall_s']:.3f}",
    ]
    for device, tok_s in zip(report["devices"], r["per_gpu_output_tok_s"]):
        lines.append(f"  {device:<20}{tok_s:.1f} output tok/s")
    return "\n".join(lines)


def _worker(index: int, opts: BenchOptions, barrier, inbox) -> None:
    """One process: the ordinary bench, its timed runs started at the barrier."""

    def log(message: str) -> None:
        inbox.put(("log", index, message))

    try:
        mine = dataclasses.replace(opts, sync=lambda: barrier.wait(BARRIER_TIMEOUT_S))
        inbox.put(("report", index, run_bench(mine, log)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        inbox.put(("error", index, detail))
