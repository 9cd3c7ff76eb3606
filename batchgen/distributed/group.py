"""TensorParallel: this process's place in a tensor-parallel group and the collectives models run.

One torch.distributed process group per engine: NCCL between GPUs, gloo between CPU processes.
Rank 0 is the engine's own process; it owns a TCPStore on a free local port that the other
ranks join. Every collective and store wait is bounded: by STARTUP_TIMEOUT_S while the engine
starts (ranks that went different ways fail soon, see also watchdog.py), by TIMEOUT_S once it
runs steps (`steady`); rank 0's worker monitor reports a dead worker sooner (workers.py).

BATCHGEN_TP_TRACE=1 in the environment makes every rank log its start-up phases and each step
(kind, shape, graph bucket) to stderr (`log`): the lines of two ranks side by side show where
they parted.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import TextIO

import torch
import torch.distributed as dist

from batchgen.config import ConfigError

# How long any one collective may wait for the other ranks while steps run. Generous: a rank
# may compile kernels for a new shape while its peers wait in the next collective.
TIMEOUT_S = 600.0
# The same during start-up (rendezvous, symmetric-memory set-up, graph warm-ups): the ranks
# settle their rank-local work (loading, GEMM tuning) over the control connections before
# any collective, so a collective waiting this long means the ranks went different ways.
STARTUP_TIMEOUT_S = 120.0
# Set to 1: every rank logs its start-up phases and steps to stderr (see the module docstring).
TRACE_ENV = "BATCHGEN_TP_TRACE"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (died, or its process group broke); the engine cannot go
    on. The message names the rank and what happened."""


class TensorParallel:
    """Rank `rank` of `size` in the default process group, on `device`.

    Models call `all_reduce` (row-parallel outputs, the vocab-parallel embedding) and
    `gather_columns` (vocab-parallel logits to rank 0); the runner calls `broadcast_`.
    """

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # Set by enable_one_shot (GPU): small all-reduces by a peer-to-peer kernel.
        self.one_shot = None
        self.one_shot_max_bytes = 0
        # Start-up checks (model_runner): a list collecting (op, route, bytes) of each
        # collective issued, and a watchdog told of each (progress).
        self.record: list[tuple[str, str, int]] | None = None
        self.watchdog = None
        # Where this rank logs its phases and steps (BATCHGEN_TP_TRACE=1), else None.
        self.log: TextIO | None = sys.stderr if os.environ.get(TRACE_ENV) == "1" else None

    @classmethod
    def start(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.TCPStore,
        timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> TensorParallel:
        """Join the group through `store` (rank 0 created it with is_master=True). Collectives
        time out after timeout_s until `steady` raises it.

        Raises:
            ConfigError: the process group cannot start (another one is live in this process,
                NCCL or gloo cannot initialise, or the other ranks did not join in time).
        """
        if dist.is_initialized():
            raise ConfigError(
                "tensor_parallel_size > 1: this process already runs a tensor-parallel engine; "
                "shut it down first (LLM.shutdown())"
            )
        self = cls(rank, size, device)
        options = {}
        if device.type == "cuda":
            # On a communicator error or timeout NCCL's watchdog then aborts the communicators
            # and lets the waiting call raise, rather than ending the process (torch's default):
            # the engine reports a dead rank itself (workers.py). Set before the group exists;
            # a value the user set is kept. Every rank sets it for itself.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            torch.cuda.set_device(device)
            options["device_id"] = device  # communicators start now, not in the first step
        # Every rank must give the default group the same name, the count of groups this
        # process made, which a failed init leaves raised (torch resets it only on destroy).
        dist.distributed_c10d._world.group_count = 0
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=timeout_s),
                **options,
            )
            # One collective now: a rank that cannot reach the others fails at start-up.
            probe = torch.ones(1, device=device)
            dist.all_reduce(probe)
            if int(probe.item()) != size:
                raise RuntimeError(f"all-reduce of ones gave {probe.item()}, expected {size}")
        except Exception as e:  # NCCL/gloo raise RuntimeError / DistBackendError subclasses
            if dist.is_initialized():
                dist.destroy_process_group()
            raise ConfigError(
                f"tensor_parallel_size={size}: rank {rank} could not start the {self.backend} "
                f"process group on {device} ({type(e).__name__}: {e})"
            ) from None
        return self

    @property
    def group_name(self) -> str:
        return dist.group.WORLD.group_name

    def steady(self, timeout_s: float = TIMEOUT_S) -> None:
        """Start-up is over: collectives may wait timeout_s from now on (steps)."""
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_s))

    def route(self, nbytes: int) -> str:
        """How an all-reduce of a contiguous tensor of nbytes runs: "one-shot" or "nccl"/"gloo"
        (the group's backend). Every rank answers alike: the threshold is agreed."""
        if self.one_shot is not None and 0 < nbytes <= self.one_shot_max_bytes:
            return "one-shot"
        return self.backend

    def _note(self, op: str, route: str, nbytes: int) -> None:
        if self.record is not None:
            self.record.append((op, route, nbytes))
        if self.watchdog is not None:
            self.watchdog.beat()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks. Returns the sum: x itself (reduced in place), or a new tensor
        where the one-shot kernel ran (small tensors on GPU, see one_shot.py) or where x is not
        contiguous (collectives read a tensor's storage as one dense block)."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if self.one_shot is not None and nbytes <= self.one_shot_max_bytes:
            out = self.one_shot(x)
            if out is not None:
                self._note("all_reduce", "one-shot", nbytes)
                return out
        self._note("all_reduce", self.backend, nbytes)
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, C] on every rank -> [N, size * C] on rank 0 (rank r's columns at r * C), None
        on the others."""
        x = x.contiguous()
        self._note("gather", self.backend, x.numel() * x.element_size())
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into x on every rank, in place."""
        self._note("broadcast", self.backend, x.numel() * x.element_size())
        dist.broadcast(x, src=0)
        return x

    def close(self) -> None:
        """Leave the process group. NCCL communicators are aborted rather than destroyed: a
        destroy can wait forever on communicators that CUDA graphs captured (pytorch#115388)
        or whose peer is gone."""
        self.one_shot = None
        if not dist.is_initialized():
            return
        if self.backend == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                    return
                except Exception:  # an older torch's abort: fall through to destroy
                    pass
        dist.destroy_process_group()


def make_store(
    rank: int, size: int, port: int, timeout_s: float = STARTUP_TIMEOUT_S
) -> dist.TCPStore:
    """Rank 0 (port 0: a free one, read back from store.port) hosts the rendezvous store on
    127.0.0.1; the other ranks connect to its port. Its waits (the process group's rendezvous,
    the symmetric-memory exchange of the one-shot all-reduce) end after timeout_s."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size=size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def default_threads(size: int) -> int:
    """Intra-op threads for one of `size` CPU ranks on this machine (they share its cores)."""
    return max(1, (os.cpu_count() or 1) // size)
