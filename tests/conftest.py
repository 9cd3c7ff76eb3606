"""Shared fixtures: tiny HF-format models written once per test session by `make_model`, and a
cache directory of the test session's own."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests need a CUDA device; deselecting keeps CPU runs honest (nothing silently passes).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    # Digests, GEMM tunings and crash reports of tests go to a directory of the test session,
    # never the user's ~/.cache/batchgen (a test that needs its own sets the variable again).
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("llama") -> path of a seeded tiny model of that architecture."""
    from batchgen.models.make_model import make_model

    made: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_model(str(path), arch, "tiny", seed=0)
            made[arch] = str(path)
        return made[arch]

    return get
