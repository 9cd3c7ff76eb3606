"""Rank 0's start of a tensor-parallel engine: checks, worker processes, the process group.

The engine's own process is rank 0: it runs all bookkeeping (scheduler, block manager, sampler)
and, each step, sends the other ranks a description of the step's inputs (`ModelRunner.launch`);
every rank then runs the model forward in lockstep, its collectives meeting the other ranks'.
Ranks 1..N-1 are worker processes (`batchgen.engine.tp_worker`) that build their share of the
model with the same builder and run ModelRunner's start-up in step with rank 0: the phases
that could fail on one rank are agreed over the control connections (ModelRunner._agree)
before the next collective, so a failing rank makes rank 0 raise instead of wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.config import ConfigError, EngineConfig
from batchgen.distributed.group import TensorParallel, make_store
from batchgen.distributed.partition import check_divides, check_gpu_count
from batchgen.distributed.workers import MONITOR_INTERVAL_S, WorkerPool
from batchgen.models.checkpoint_check import check_checkpoint
from batchgen.models.config import ModelConfig
from batchgen.models.loader import CheckpointLoader
from batchgen.models.quantization import load_plan

WORKER_MODULE = "batchgen.engine.tp_worker"

# (device, tp or None) -> the model (this rank's share): models.loader.CheckpointLoader, or a
# benchmark's random-weight builder. Picklable: rank 0 sends it to the workers.
ModelBuilder = Callable[[torch.device, "TensorParallel | None"], Any]


@dataclass(frozen=True)
class WorkerSetup:
    """What rank 0 sends a worker at start: its place and everything to build its runner."""

    rank: int
    size: int
    store_port: int
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    build: ModelBuilder


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the engine's (cuda:K -> cuda:K + r); CPU for all."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig) -> None:
    """The start-up errors, before any process starts or weight loads: a size that does not
    split the model; more GPUs than visible (where the engine would run on CUDA: device cuda*,
    or auto with a GPU visible).

    Raises:
        ConfigError: naming the option and the model's size at fault.
        ModelLoadError: FP8 weights the split or the model cannot take (quantization/).
    """
    size = config.tensor_parallel_size
    check_divides(model_config, size)
    if size > 1:  # the quantization refusals (MoE, weight blocks a rank would cut) come first
        load_plan(model_config, config.quantization, f"{config.model}/config.json", size)
    if size > 1 and config.device != "cpu" and torch.cuda.is_available():
        index = int(config.device.split(":")[1]) if ":" in config.device else 0
        check_gpu_count(size, index, torch.cuda.device_count())


def start_tensor_parallel(
    config: EngineConfig,
    model_config: ModelConfig,
    max_model_len: int,
    build: ModelBuilder,
    device: torch.device,
) -> tuple[TensorParallel, WorkerPool]:
    """Check, start ranks 1..N-1, and join the process group as rank 0.

    Raises:
        ConfigError: the size cannot split the model, too few GPUs, the group cannot start.
        ModelLoadError: the checkpoint's headers do not fit its config, or its 4-bit tensors
            cannot split over the ranks (checked here, before any worker starts).
        TensorParallelError: a worker died or failed while starting.
    """
    check_tensor_parallel(config, model_config)
    size = config.tensor_parallel_size
    if isinstance(build, CheckpointLoader):
        check_checkpoint(build.path, model_config, build.allow_pickle, size)
    store = make_store(0, size, 0)

    def setup(rank: int) -> WorkerSetup:
        return WorkerSetup(rank, size, store.port, config, model_config, max_model_len, build)

    pool = WorkerPool.start(size, WORKER_MODULE, setup)
    try:
        return _join(size, device, store, pool), pool
    except BaseException:
        pool.close()
        raise


def _join(size: int, device: torch.device, store, pool: WorkerPool) -> TensorParallel:
    """TensorParallel.start for rank 0, in a helper thread while this one watches the workers:
    a worker that dies before joining would leave the rendezvous waiting for its timeout."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["tp"] = TensorParallel.start(0, size, device, store)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, name="tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(MONITOR_INTERVAL_S)
        pool.check()
    if "error" in result:
        raise result["error"]
    tp = result["tp"]
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the helper thread's set_device does not carry over
    return tp


def resolve_kind(kind: str, message: str) -> Exception | None:
    """The exception a worker's error of class `kind` stands for on rank 0: configuration and
    model errors keep their class (the pipeline maps them to a job error), others stay
    TensorParallelError (None)."""
    from batchgen.models.errors import ModelLoadError

    if kind == "ModelLoadError":
        return ModelLoadError(message)
    if kind == "ConfigError":
        return ConfigError(message)
    return None
