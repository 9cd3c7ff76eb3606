"""Data parallel sizing: how many engine workers a run starts and which GPUs each one gets.

`model.data_parallel_size` (auto by default) times `tensor_parallel_size` GPUs are taken from
the visible ones in order (from cuda:K for `device: cuda:K`), one group of
tensor_parallel_size per worker; each worker sees only its group (CUDA_VISIBLE_DEVICES), so
its engine runs on its cuda:0 .. cuda:T-1. On CPU the workers are plain processes (tests).
Everything here is decided before any input row is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

from batchgen.cpu_threads import default_cpu_threads
from batchgen.job import JobError, JobSpec


@dataclass(frozen=True)
class Placement:
    """Worker `index`'s GPUs: entries of CUDA_VISIBLE_DEVICES, empty on CPU."""

    index: int
    gpus: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How messages name the worker's devices: `GPU 3`, `GPUs 2,3` or `cpu`."""
        if not self.gpus:
            return "cpu"
        return f"GPU{'s' if len(self.gpus) > 1 else ''} {','.join(self.gpus)}"


def visible_gpus() -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the GPUs torch sees here, in cuda:N order."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in listed.split(",") if d.strip()][:count]


def place_workers(job: JobSpec, gpus: list[str]) -> list[Placement]:
    """One Placement per worker (a single one: run in this process).

    Raises:
        JobError: more GPUs asked for (data_parallel_size x tensor_parallel_size) than visible.
    """
    engine = job.model.engine_config()
    tp, want = engine.tensor_parallel_size, job.model.data_parallel_size
    device = engine.device
    if device == "cpu" or (device == "auto" and not gpus):
        return [Placement(i) for i in range(want or 1)]
    first = int(device.split(":")[1]) if ":" in device else 0
    available = max(0, len(gpus) - first)
    if want is None:  # auto: every whole group (a GPU named by cuda:K is that GPU alone)
        want = 1 if ":" in device else max(1, available // tp)
    if want == 1:
        return [Placement(0)]  # the engine's own checks name a tensor_parallel_size too large
    if want * tp > available:
        start = f" from cuda:{first} on" if first else ""
        raise JobError(
            f"{job.source}: model.data_parallel_size={want} x tensor_parallel_size={tp} needs "
            f"{want * tp} GPUs{start}, but {available} are visible (CUDA_VISIBLE_DEVICES chooses "
            "which); lower data_parallel_size or make more GPUs visible"
        )
    return [Placement(i, tuple(gpus[first + i * tp : first + (i + 1) * tp])) for i in range(want)]


def worker_job(job: JobSpec, placement: Placement, size: int) -> JobSpec:
    """The job as one worker runs it: one engine (data_parallel_size 1) on its own GPUs
    (cuda:K becomes cuda: the worker sees its group only), or on CPU its share of the CPUs
    unless cpu_threads or OMP_NUM_THREADS says otherwise. None of this is in the fingerprint."""
    options = dict(job.model.options)
    if placement.gpus and str(options.get("device", "auto")).startswith("cuda"):
        options["device"] = "cuda"
    if not placement.gpus and options.get("cpu_threads") is None:
        if not os.environ.get("OMP_NUM_THREADS"):
            options["cpu_threads"] = max(1, default_cpu_threads() // size)
    model = dataclasses.replace(
        job.model, options=tuple(sorted(options.items())), data_parallel_size=1
    )
    return dataclasses.replace(job, model=model)


@contextlib.contextmanager
def cuda_visible(gpus: tuple[str, ...]) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `gpus` while a worker process is started (it inherits the
    environment); nothing changes for a CPU worker (no GPUs)."""
    if not gpus:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
