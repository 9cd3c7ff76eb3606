"""PinnedStager on CUDA: values arrive intact, buffers are reused by alternate steps and grown
only when a step needs more."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.engine.host_to_device import PinnedStager

pytestmark = pytest.mark.gpu


def test_round_trip_reuse_and_growth():
    stager = PinnedStager(torch.device("cuda"))
    seen = []
    for step in range(6):
        stager.begin_step()
        ids = list(range(step, step + 100 * (step + 1)))
        a = stager.to_device(ids, torch.int64)
        b = stager.to_device(np.arange(12, dtype=np.int32).reshape(3, 4), torch.int32)
        c = stager.to_device([[1.5, 2.5], [3.5, 4.5]], torch.float32)
        back = stager.to_host(a * 2)
        torch.cuda.synchronize()
        assert a.is_cuda and a.tolist() == ids
        assert b.shape == (3, 4) and b.flatten().tolist() == list(range(12))
        assert c.tolist() == [[1.5, 2.5], [3.5, 4.5]]
        assert back.is_pinned() and back.tolist() == [2 * i for i in ids]
        seen.append([buf.data_ptr() for buf in stager._sets[stager._turn]])
    # Set 0 serves steps 1, 3, 5 and set 1 steps 0, 2, 4; a buffer is replaced only when it
    # must grow (the first one grows with the id list: 100, 200, ... 600 int64s).
    assert len(seen[0]) == len(seen[1]) == 4
    assert seen[2][1:] == seen[0][1:] and seen[3][1:] == seen[1][1:]
