"""Weight files of a model directory: which ones the loader reads, pickle refused unless allowed.

No torch here: the job fingerprint and `batchgen validate` list the files without it.
"""

from __future__ import annotations

import glob
import json
import os

from batchgen.models.errors import ModelLoadError


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


def has_weight_files(path: str) -> bool:
    """Whether `path` holds any weight file or shard index at all (valid or not)."""
    names = os.listdir(path) if os.path.isdir(path) else []
    return any(n.endswith((".safetensors", ".bin", ".safetensors.index.json")) for n in names)
