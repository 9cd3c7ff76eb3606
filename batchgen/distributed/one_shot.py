"""One-shot all-reduce for small tensors on GPUs: one kernel reads every peer's copy directly.

NCCL's all-reduce of a decode step's activations ([rows, hidden], tens of KB to a few MB) costs
its latency, not bandwidth. torch's symmetric memory gives each rank a buffer that every peer
maps (CUDA IPC), and its `one_shot_all_reduce_copy_out` kernel copies the local tensor into
this rank's buffer, meets the peers at a barrier of signal flags, then sums all peers' buffers
straight from their memory over NVLink: one launch, no rings, no multicast (NVLink multicast is
off on our machines; nothing here uses it). The kernel is a plain launch with fixed device
pointers, so CUDA graphs capture it.

Whether to use it, and below which size, is measured at start-up (select_one_shot): correct
eagerly and inside a replayed CUDA graph against NCCL, then timed against NCCL inside graphs
at decode sizes; every rank takes the same decision (the slowest rank's timings). Anything
missing or failing keeps NCCL. `python -m batchgen.bench.allreduce` prints the same
measurement.

Once per process: torch keeps the symmetric-memory rendezvous state per process, not per
process group. Its exchange of peer handles through the group's store numbers its keys with a
process-wide sequence count, and it remembers the store of each group *name* (the default
group is always "0"). A second tensor-parallel engine in the caller's process (rank 0) would
meet fresh worker processes whose counts start again at 0: the ranks wait for keys the others
never write, and the start-up hangs. So only the first engine of a process rendezvouses; later
ones all-reduce through NCCL (`available` says why).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

# The kernel handles bf16 and fp32 (torch's dispatch); fp16 stays on NCCL.
_DTYPES = (torch.bfloat16, torch.float32)
# Timing: all-reduces per captured graph, replays timed (median).
_CALLS_PER_GRAPH = 16
_REPLAYS = 7

# Set once this process has begun a symmetric-memory rendezvous (see the module docstring).
_rendezvous_begun = False


def _alignment(nbytes: int) -> int:
    """The vector width (4, 8 or 16 bytes) the kernel would use for an offset/size of nbytes."""
    for a in (16, 8, 4):
        if nbytes % a == 0:
            return a
    return 0


def available() -> str | None:
    """None if this process can run the one-shot kernel, else why not."""
    if _rendezvous_begun:
        return (
            "an earlier tensor-parallel engine in this process set up symmetric memory, whose "
            "rendezvous torch cannot repeat with new worker processes (its state is per "
            "process); this engine all-reduces through NCCL"
        )
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError as e:
        return f"no symmetric memory in this torch ({e})"
    op = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
    if op is None:
        return "this torch has no symm_mem.one_shot_all_reduce_copy_out"
    return None


class OneShotAllReduce:
    """Sum of small tensors over the group by torch's one-shot symmetric-memory kernel.

    Args:
        group_name: the process group (every rank constructs this together: rendezvous).
        max_bytes: the largest tensor it serves (its buffer's size).
        device: this rank's GPU.
    """

    def __init__(self, group_name: str, max_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        global _rendezvous_begun
        _rendezvous_begun = True  # even if it fails: its state may be half set
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: False)
        if enable is not None and not enabled(group_name):
            with warnings.catch_warnings():  # required by older torch, deprecated in newer
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)
        self.group_name = group_name
        self.max_bytes = max_bytes
        # One byte buffer; each call views its first x.nbytes as x's dtype.
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def usable(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes x: bf16/fp32, contiguous, within the buffer, and aligned as
        the buffer's view is (the kernel requires equal alignment)."""
        nbytes = x.numel() * x.element_size()
        if x.dtype not in _DTYPES or not x.is_contiguous() or not 0 < nbytes <= self.max_bytes:
            return False
        size_align = _alignment(nbytes)
        offset = x.storage_offset() * x.element_size()
        return size_align > 0 and (offset == 0 or _alignment(offset) >= size_align)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the ranks as a new tensor, or None where x is not usable (the
        caller then runs NCCL; every rank decides alike, their x being alike in shape)."""
        if not self.usable(x):
            return None
        symm = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        self._op(symm, x, "sum", self.group_name, out)
        return out


def _nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def graph_us(reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """us per all-reduce of x's shape by `reduce`, inside a replayed CUDA graph of
    _CALLS_PER_GRAPH calls (median of _REPLAYS replays). Collective: every rank calls it."""
    reduce(x.clone())  # warm: NCCL or the kernel set up outside the capture
    torch.cuda.synchronize()
    bufs = [x.clone() for _ in range(_CALLS_PER_GRAPH)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in bufs:
            reduce(b)
    times = []
    for _ in range(_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / _CALLS_PER_GRAPH)
    del graph
    return sorted(times)[len(times) // 2]


def check_correct(one_shot: OneShotAllReduce, x: torch.Tensor) -> str | None:
    """None if the kernel's sum equals NCCL's eagerly and in a replayed graph (fp32 inputs of
    small integers, so any summation order is exact), else what differed. Collective."""
    rank = dist.get_rank()
    x = x.to(torch.float32)
    x.copy_(torch.arange(x.numel(), device=x.device).view(x.shape) % 7 + rank)
    expected = _nccl(x.clone())
    eager = one_shot(x)
    if eager is None or not torch.equal(eager, expected):
        return "eager sum differs from NCCL's"
    src = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_shot(src)
    for shift in (1, 2):  # replays with new inputs: the graph reads the live buffers
        src.copy_(x + shift)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, expected + shift * dist.get_world_size()):
            return f"graph replay {shift} differs from NCCL's sum"
    return None


def measure(
    one_shot: OneShotAllReduce, hidden: int, rows: list[int], dtype: torch.dtype, device
) -> list[tuple[int, float, float]]:
    """(bytes, NCCL us, one-shot us) for all-reduces of [rows, hidden] on this rank, each
    inside CUDA graphs. Collective."""
    out = []
    for n in rows:
        x = torch.randn(n, hidden, dtype=dtype, device=device)
        if not one_shot.usable(x):
            continue
        out.append((x.numel() * x.element_size(), graph_us(_nccl, x), graph_us(one_shot, x)))
    return out


def threshold(timings: list[tuple[int, float, float]]) -> int:
    """The largest size up to which the one-shot kernel won every measured size (0: never)."""
    best = 0
    for nbytes, nccl_us, one_us in sorted(timings):
        if one_us >= nccl_us:
            break
        best = nbytes
    return best


def select_one_shot(
    tp, agree: Callable, hidden: int, max_rows: int, dtype: torch.dtype
) -> tuple[int, list[tuple[int, float, float]], str | None]:
    """Measure, and enable on `tp` (a TensorParallel) where it wins, the one-shot all-reduce
    for [rows, hidden] activations of up to max_rows rows.

    `agree(phase, value, reduce)` settles one value across the ranks (the engine's control
    connection, which cannot hang on a failed rank as a collective would): every step that
    could fail on one rank is agreed before the next collective. Returns (the threshold in
    bytes, 0 for never; the slowest rank's timings; why it is off, or None).
    """
    why = available() if tp.device.type == "cuda" and dtype in _DTYPES else "not a bf16/fp32 GPU"
    why = agree("one-shot available", why, lambda vs: next((v for v in vs if v), None))
    if why is not None:
        return 0, [], why
    # Room for max_rows rows, and for the check's fp32 sample of 4 rows.
    max_bytes = max(max_rows * hidden * torch.tensor([], dtype=dtype).element_size(), 16 * hidden)
    one_shot, error = None, None
    try:
        one_shot = OneShotAllReduce(tp.group_name, max_bytes, tp.device)
    except Exception as e:  # noqa: BLE001 - any failure keeps NCCL
        error = f"symmetric memory: {type(e).__name__}: {e}"
    error = agree("one-shot buffer", error, lambda vs: next((v for v in vs if v), None))
    if error is not None:
        return 0, [], error
    try:
        sample = torch.empty(min(max_rows, 4), hidden, dtype=torch.float32, device=tp.device)
        error = check_correct(one_shot, sample)
    except Exception as e:  # noqa: BLE001
        error = f"check: {type(e).__name__}: {e}"
    error = agree("one-shot check", error, lambda vs: next((v for v in vs if v), None))
    if error is not None:
        return 0, [], error
    rows = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if r <= max_rows})
    timings = measure(one_shot, hidden, rows, dtype, tp.device)
    # The slowest rank's time per size: every rank must choose alike.
    timings = agree(
        "one-shot timings",
        timings,
        lambda vs: [(t[0][0], max(x[1] for x in t), max(x[2] for x in t)) for t in zip(*vs)],
    )
    limit = threshold(timings)
    if limit:
        tp.one_shot, tp.one_shot_max_bytes = one_shot, limit
    return limit, timings, None if limit else "NCCL was as fast at every size measured"
