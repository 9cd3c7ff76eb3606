"""The one-shot all-reduce's host-side rules (the kernel itself runs on GPUs only: see
tests/gpu/test_tensor_parallel_gpu.py): which tensors it takes and the size it is used up to."""

from __future__ import annotations

import torch

from batchgen.distributed.one_shot import OneShotAllReduce, threshold


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
