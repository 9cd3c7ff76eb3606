"""Tensor parallel for 4-bit checkpoints: the block of each format tensor a rank reads.

The model names the block of a projection's 16-bit weight [N, K] a rank holds (tp_slice): rows
of N for the column-parallel projections (q/k/v, gate/up, the LM head), columns of K for the
row-parallel ones (o, down). The same block of each format tensor is read from the file, in
that tensor's own dimension and units: packed int32 words hold 8 values (the block must be a
multiple of 8 there), scales and zero points one row or column per group (the block must be
whole groups; one group per channel: all of it), g_idx one entry per input channel.

`check_split` runs these rules for every rank from the headers alone, before any model is built
or process started, and refuses act order (a g_idx that is not in group order) for the
row-parallel projections: each group's input channels would be spread over every rank.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from batchgen.config import ConfigError
from batchgen.distributed.partition import Partition, RowBlock
from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.int4.checkpoint import Int4Checkpoint
from batchgen.models.llama import weight_block

# method -> suffix -> (for an N block, for a K block): (tensor dim, unit) or None (whole).
# A unit of 0 means "the group size".
_GROUP = 0
_SLICES = {
    "gptq": {
        "qweight": ((1, 1), (0, 8)),
        "qzeros": ((1, 8), (0, _GROUP)),
        "scales": ((1, 1), (0, _GROUP)),
        "g_idx": (None, (0, 1)),
    },
    "awq": {
        "qweight": ((1, 8), (0, 1)),
        "qzeros": ((1, 8), (0, _GROUP)),
        "scales": ((1, 1), (0, _GROUP)),
    },
    "compressed-tensors": {
        "weight_packed": ((0, 1), (1, 8)),
        "weight_scale": ((0, 1), (1, _GROUP)),
        "weight_zero_point": ((0, 8), (1, _GROUP)),  # (0, 1) when stored unpacked, int8 [N, G]
        "weight_shape": (None, None),
        "weight_g_idx": (None, (0, 1)),
    },
}


def format_slice(
    method: str,
    suffix: str,
    weight_dim: int,
    block: RowBlock,
    group_size: int,
    unpacked_rows: bool = False,
) -> tuple[int, RowBlock] | None:
    """The (dim, block) of format tensor `suffix` matching `block` of the weight's dim
    `weight_dim` (0: N, 1: K); None: read it whole. unpacked_rows: a compressed-tensors zero
    point stored unpacked (one row per output channel).

    Raises:
        ValueError: the block does not fall on whole packed words or groups.
    """
    spec = _SLICES[method][suffix][weight_dim]
    if spec is None:
        return None
    dim, unit = spec
    if suffix == "weight_zero_point" and weight_dim == 0 and unpacked_rows:
        unit = 1
    if unit == _GROUP:
        if group_size == -1:
            return None  # one group per channel: every rank needs its one row of scales
        unit = group_size
    for value in (block.start, block.length):
        if value % unit:
            what = "packed words of 8" if unit == 8 else f"groups of {unit}"
            side = "outputs" if weight_dim == 0 else "inputs"
            raise ValueError(
                f"a rank's {block.length} {side} (from {block.start}) do not fall on whole {what}"
            )
    return dim, RowBlock(block.start // unit, block.length // unit, block.full // unit)


def check_split(ckpt: Int4Checkpoint, config: ModelConfig, size: int) -> None:
    """Refuse a 4-bit checkpoint that `size` tensor-parallel ranks cannot load: a rank's block
    of some 4-bit module that is not whole packed words or groups, or an act-order g_idx on a
    row-parallel projection. Reads the headers' shapes and those projections' g_idx only.

    Raises:
        ModelLoadError: naming config.json, the tensor_parallel_size and the module.
    """
    if size == 1:
        return
    try:
        parts = [Partition.of(config, rank, size) for rank in range(size)]
    except ConfigError:
        return  # a size that does not split the model: check_tensor_parallel says so
    scheme = ckpt.scheme
    where = f"{ckpt.source}: tensor_parallel_size={size}"
    for module, (n, k) in ckpt.modules.items():
        for part in parts:
            found = weight_block(part, module + ".weight")
            if found is None:
                continue
            dim, block = found
            for suffix in scheme.suffixes:
                info = ckpt.tensors.get(f"{module}.{suffix}")
                if info is None:
                    continue
                try:
                    format_slice(scheme.method, suffix, dim, block, scheme.group_size,
                                 info.shape[0] == n)  # fmt: skip
                except ValueError as e:
                    raise ModelLoadError(f"{where} cannot split {module}: {e}") from None
        found = weight_block(parts[0], module + ".weight")
        if found is not None and found[0] == 1:
            _refuse_act_order(ckpt, module, k, where)


def _refuse_act_order(ckpt: Int4Checkpoint, module: str, k: int, where: str) -> None:
    """ModelLoadError if row-parallel `module`'s g_idx (if stored) is not in group order."""
    group = k if ckpt.scheme.group_size == -1 else ckpt.scheme.group_size
    for suffix in ("g_idx", "weight_g_idx"):
        info = ckpt.tensors.get(f"{module}.{suffix}")
        if info is None:
            continue
        with safe_open(info.file, "pt") as f:
            g_idx = f.get_tensor(f"{module}.{suffix}")  # [K] int32: a few KB
        if not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ModelLoadError(
                f"{where}: {module}.{suffix} is in act order (desc_act): its groups' input "
                "channels are spread over every rank, so a row-parallel rank cannot hold whole "
                "groups; run this checkpoint with tensor_parallel_size 1"
            )
