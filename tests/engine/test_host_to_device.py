"""host_tensor: the fast flat-int-list path gives what torch.as_tensor gives."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from batchgen.engine.host_to_device import PinnedStager, host_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_flat_int_lists_match_as_tensor(dtype):
    values = [0, -1, 7, 2**31 - 1, -(2**31), 123456]  # slot -1 pads; int32 extremes
    got = host_tensor(values, dtype)
    gc.collect()  # the tensor keeps its buffer alive
    assert got.dtype == dtype
    assert torch.equal(got, torch.as_tensor(values, dtype=dtype))


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([], torch.int64),
        ([[1, 2], [3, 4]], torch.int32),
        (np.arange(5, dtype=np.int64), torch.int32),
        ([0.5, 1.5], torch.float32),
        ([True, False], torch.int64),
    ],
)
def test_other_inputs_fall_back_to_as_tensor(values, dtype):
    got = host_tensor(values, dtype)
    assert torch.equal(got, torch.as_tensor(values, dtype=dtype))


def test_int32_overflow_is_an_error():
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)


def test_stager_on_cpu_returns_host_values():
    stager = PinnedStager(torch.device("cpu"))
    stager.begin_step()
    out = stager.to_device(list(range(40)), torch.int64)
    assert torch.equal(out, torch.arange(40))
