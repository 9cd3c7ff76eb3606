"""ModelRunner's device resolution: a device torch cannot use is a ConfigError, not a crash."""

from __future__ import annotations

import pytest
import torch

from batchgen.config import ConfigError
from batchgen.engine.model_runner import resolve_device


def test_cuda_index_past_the_visible_devices_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"device='cuda:2': torch sees 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")
