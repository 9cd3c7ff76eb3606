"""The one-shot all-reduce's host-side rules (the kernel itself runs on GPUs only: see
tests/gpu/test_tensor_parallel_gpu.py): which tensors it takes, the size it is used up to, and
once per process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchgen.distributed import one_shot
from batchgen.distributed.group import TensorParallel
from batchgen.distributed.one_shot import OneShotAllReduce, select_one_shot, threshold


def kernel_stub(max_bytes: int) -> OneShotAllReduce:
    stub = OneShotAllReduce.__new__(OneShotAllReduce)  # no symmetric memory on CPU
    stub.max_bytes = max_bytes
    return stub


def test_threshold_is_the_largest_size_of_an_unbroken_win():
    timings = [(1024, 10.0, 4.0), (4096, 11.0, 6.0), (16384, 12.0, 13.0), (65536, 20.0, 9.0)]
    assert threshold(timings) == 4096  # a later win past a loss does not count
    assert threshold([(1024, 5.0, 6.0)]) == 0
    assert threshold([]) == 0


def test_usable_tensors():
    k = kernel_stub(4096)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)  # 512 bytes
    assert k.usable(x)
    assert k.usable(torch.zeros(8, 64))  # fp32
    assert not k.usable(torch.zeros(4, 64, dtype=torch.float16))  # no fp16 kernel
    assert not k.usable(torch.zeros(64, 64))  # 16 KB: past the buffer
    assert not k.usable(x.t())  # not contiguous
    assert not k.usable(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes: under 4-byte vectors
    # A view must be aligned like the buffer's view of the same size (the kernel's rule).
    flat = torch.zeros(1024, dtype=torch.bfloat16)
    assert k.usable(flat[8:16])  # offset 16 bytes, size 16 bytes
    assert not k.usable(flat[2:10])  # offset 4 bytes, size 16 bytes


def test_a_second_engine_in_a_process_keeps_nccl(monkeypatch):
    """torch's symmetric-memory rendezvous keeps per-process state (a sequence count of store
    keys, the store of each group name): once this process has begun one, a later engine's
    fresh workers could never meet it. The first attempt marks the process, even when it fails;
    later engines then settle on NCCL with the reason, before any rendezvous."""
    monkeypatch.setattr(one_shot, "_rendezvous_begun", False)
    with pytest.raises(RuntimeError, match="process group"):  # none here: the set-up fails
        OneShotAllReduce("0", 4096, torch.device("cpu"))
    assert one_shot._rendezvous_begun
    why = one_shot.available()
    assert "an earlier tensor-parallel engine in this process" in why
    tp = SimpleNamespace(device=torch.device("cuda", 0))  # select_one_shot reads only this

    def agree(phase, value, reduce):
        assert phase == "one-shot available"  # nothing past the first agreement runs
        return reduce([value, None])  # rank 1 (a fresh worker) would have no objection

    assert select_one_shot(tp, agree, 64, 16, torch.bfloat16) == (0, [], why)


def test_route_names_how_an_all_reduce_runs():
    tp = TensorParallel(0, 2, torch.device("cpu"))
    assert tp.route(256) == "gloo"
    tp.one_shot, tp.one_shot_max_bytes = kernel_stub(4096), 1024
    assert (tp.route(1024), tp.route(1025)) == ("one-shot", "gloo")
