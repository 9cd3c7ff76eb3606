"""Tensors of a model's weight files (found by weight_files.py), read onto the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from batchgen.models.errors import ModelLoadError


def iter_tensors(files: list[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yields (file, tensor name, tensor on CPU) for every tensor in the checkpoint files."""
    for file in files:
        if file.endswith(".safetensors"):
            yield from _iter_safetensors(file)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ModelLoadError(
                    f"{file}: cannot be loaded with weights_only=True ({e})"
                ) from e
            for name, tensor in state.items():
                yield file, name, tensor


def _iter_safetensors(file: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError for truncated/garbled files
        raise ModelLoadError(
            f"{file}: not a readable safetensors file ({e}); the download may be truncated"
        ) from e
    with handle as f:
        for name in f.keys():
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise ModelLoadError(f"{file}: tensor {name!r} cannot be read ({e})") from e
            yield file, name, tensor
