"""check_block_split: whether tensor-parallel ranks can split an FP8 checkpoint's block-scaled
weights into whole blocks, from config.json alone (before any rank starts)."""

from __future__ import annotations

from batchgen.distributed.partition import Partition, RowBlock
from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.quantization.schemes import CheckpointScheme

# Hugging Face projection -> (its parent module, the dimension a rank splits: 0 rows, 1 columns,
# whether another piece follows it in its fused projection: q, k before v; gate before up).
_SPLITS = {
    "q_proj": ("self_attn", 0, True),
    "k_proj": ("self_attn", 0, True),
    "v_proj": ("self_attn", 0, False),
    "o_proj": ("self_attn", 1, False),
    "gate_proj": ("mlp", 0, True),
    "up_proj": ("mlp", 0, False),
    "down_proj": ("mlp", 1, False),
}


def _block_of(part: Partition, projection: str) -> RowBlock:
    if projection in ("q_proj", "o_proj"):
        return part.q_rows()
    if projection in ("k_proj", "v_proj"):
        return part.kv_rows()
    return part.intermediate_rows()


def check_block_split(
    config: ModelConfig, scheme: CheckpointScheme, size: int, source: str
) -> None:
    """Raise ModelLoadError unless each of `size` ranks holds whole weight blocks of every
    block-scaled projection: its rows (q/k/v, gate/up) or columns (o, down) start on a block
    boundary and end on one or at the tensor's end, and a piece fused before another (q, k,
    gate) holds whole blocks only (its block scales are stacked with the next piece's)."""
    if size < 2:
        return
    for rank in range(size):
        part = Partition.of(config, rank, size)
        for layer in range(config.num_hidden_layers):
            for projection, (parent, dim, fused_before) in _SPLITS.items():
                module = f"model.layers.{layer}.{parent}.{projection}"
                fp8 = scheme.scheme_of(module)
                if fp8 is None or fp8.weight != "block":
                    continue
                block, width = _block_of(part, projection), fp8.block[dim]
                end = block.start + block.length
                whole = block.start % width == 0 and (
                    block.length % width == 0 or (end == block.full and not fused_before)
                )
                if not whole:
                    raise ModelLoadError(
                        f"{source}: tensor_parallel_size={size} gives rank {rank} "
                        f"{'rows' if dim == 0 else 'columns'} [{block.start}, {end}) of "
                        f"{module}, not whole {width}-wide weight blocks of this FP8 "
                        "checkpoint; choose a tensor_parallel_size that splits it into whole "
                        "blocks"
                    )
