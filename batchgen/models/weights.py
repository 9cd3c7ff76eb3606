"""Tensors of a model's weight files (found by weight_files.py), read onto the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from batchgen.distributed.partition import RowBlock
from batchgen.models.errors import ModelLoadError

# name -> (dim, block) of the tensor to read, or None for all of it (model.tp_slice).
Select = Callable[[str], "tuple[int, RowBlock] | None"]


def iter_tensors(
    files: list[str], select: Select | None = None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yields (file, tensor name, tensor on CPU) for every tensor in the checkpoint files.

    select(name), where given, names a block of rows (dim 0) or columns (dim 1) to read instead
    of the whole tensor: a tensor-parallel rank's share. Safetensors files are read slice by
    slice (only those bytes leave the file); pickle files are loaded whole, then cut.
    """
    for file in files:
        if file.endswith(".safetensors"):
            yield from _iter_safetensors(file, select)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ModelLoadError(
                    f"{file}: cannot be loaded with weights_only=True ({e})"
                ) from e
            for name, tensor in state.items():
                part = select(name) if select is not None else None
                if part is not None:
                    dim, block = part
                    _check_full(file, name, tuple(tensor.shape), dim, block)
                    tensor = tensor.narrow(dim, block.start, block.length)
                yield file, name, tensor


def _check_full(file: str, name: str, shape: tuple, dim: int, block: RowBlock) -> None:
    """The whole tensor must have the size the config gives the split dimension."""
    if len(shape) <= dim or shape[dim] != block.full:
        raise ModelLoadError(
            f"{file}: tensor {name!r} has shape {shape} but the model expects {block.full} "
            f"along dim {dim} (from config.json); the config and weights do not belong together"
        )


def _read_slice(f, file: str, name: str, dim: int, block: RowBlock) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) `block` of tensor `name`, read from the file alone."""
    view = f.get_slice(name)
    _check_full(file, name, tuple(view.get_shape()), dim, block)
    index = (slice(None),) * dim + (slice(block.start, block.start + block.length),)
    return view[index]


def _iter_safetensors(
    file: str, select: Select | None = None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError for truncated/garbled files
        raise ModelLoadError(
            f"{file}: not a readable safetensors file ({e}); the download may be truncated"
        ) from e
    with handle as f:
        for name in f.keys():
            part = select(name) if select is not None else None
            try:
                tensor = f.get_tensor(name) if part is None else _read_slice(f, file, name, *part)
            except ModelLoadError:
                raise
            except Exception as e:
                raise ModelLoadError(f"{file}: tensor {name!r} cannot be read ({e})") from e
            yield file, name, tensor
