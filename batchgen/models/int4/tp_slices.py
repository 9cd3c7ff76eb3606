"""Tensor parallel for 4-bit checkpoints: the block of each format tensor a rank reads.

The model names the block of a projection's 16-bit weight [N, K] a rank holds (tp_slice): rows
of N for the column-parallel projections (q/k/v, gate/up, the LM head), columns of K for the
row-parallel ones (o, down). The same block of each format tensor is read from the file, in
that tensor's own dimension and units: packed int32 words hold 8 values (the block must be a
multiple of 8 there), scales and zero points one row or column per group (the block must be
whole groups; one group per channel: all of it), g_idx one entry per input channel.
"""

from __future__ import annotations

from batchgen.distributed.partition import RowBlock

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
