"""Weight files of a model directory: find them, refuse pickle unless allowed, iterate tensors."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from batchgen.models.errors import ModelLoadError

_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin")


def find_weight_files(path: str, allow_pickle: bool = False) -> list[str]:
    """The checkpoint files to read, safetensors first.

    Raises:
        ModelLoadError: no weights, a broken shard index, or pickle files without opt-in.
    """
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _files_from_index(path, index)
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if shards:
        return shards
    pickles = sorted(glob.glob(os.path.join(path, "*.bin")))
    if pickles:
        if not allow_pickle:
            raise ModelLoadError(
                f"{path}: only pickle checkpoints found "
                f"({', '.join(map(os.path.basename, pickles))}); "
                "pickle files can run code when loaded, so they are refused. Convert the model to "
                "safetensors, or opt in with `model.allow_pickle: true` (loaded with "
                "torch.load(weights_only=True))"
            )
        index_bin = os.path.join(path, "pytorch_model.bin.index.json")
        return _files_from_index(path, index_bin) if os.path.isfile(index_bin) else pickles
    raise ModelLoadError(
        f"{path}: no weights found — expected model.safetensors, or "
        "model-0000x-of-0000y.safetensors with model.safetensors.index.json"
    )


def _files_from_index(path: str, index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{index}: not a valid shard index ({e})") from e
    files = []
    for name in sorted(set(weight_map.values())):
        full = os.path.join(path, name)
        if os.path.dirname(os.path.normpath(name)) or not os.path.isfile(full):
            raise ModelLoadError(f"{index}: lists shard {name!r}, which is not in {path}")
        files.append(full)
    return files


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
