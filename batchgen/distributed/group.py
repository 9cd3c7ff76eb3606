"""TensorParallel: this process's place in a tensor-parallel group and the collectives models run.

One torch.distributed process group per engine: NCCL between GPUs, gloo between CPU processes.
Rank 0 is the engine's own process; it owns a TCPStore on a free local port that the other
ranks join. Every collective is bounded by `timeout_s` (a lost peer fails the call instead of
hanging it; rank 0's worker monitor reports a dead worker sooner, see workers.py).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from batchgen.config import ConfigError

# How long rendezvous and any one collective may wait for the other ranks. Generous: ranks also
# wait on each other's start-up work (loading shards, GEMM tuning) inside collectives.
TIMEOUT_S = 600.0


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

    @classmethod
    def start(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.TCPStore,
        timeout_s: float = TIMEOUT_S,
    ) -> TensorParallel:
        """Join the group through `store` (rank 0 created it with is_master=True).

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks. Returns the sum: x itself (reduced in place), or a new tensor
        where the one-shot kernel ran (small tensors on GPU, see one_shot.py) or where x is not
        contiguous (collectives read a tensor's storage as one dense block)."""
        x = x.contiguous()
        if self.one_shot is not None and x.numel() * x.element_size() <= self.one_shot_max_bytes:
            out = self.one_shot(x)
            if out is not None:
                return out
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, C] on every rank -> [N, size * C] on rank 0 (rank r's columns at r * C), None
        on the others."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into x on every rank, in place."""
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


def make_store(rank: int, size: int, port: int, timeout_s: float = TIMEOUT_S) -> dist.TCPStore:
    """Rank 0 (port 0: a free one, read back from store.port) hosts the rendezvous store on
    127.0.0.1; the other ranks connect to its port."""
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
