"""Structured-output engine tests: the shared schemas importable, one tiny model and engine per
module, and torch on one thread (the CPU decode path loops over sequences; on a machine shared
with other processes two threads fight over two cores and run many times slower)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
