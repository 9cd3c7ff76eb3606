"""How many KV-cache blocks an engine (or a tensor-parallel rank) allocates: the configured
number, on CPU a memory budget, on GPU what is left after the weights and a peak step."""

from __future__ import annotations

import torch

from batchgen.config import EngineConfig
from batchgen.layers.context import AttentionContext


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype):
    """Bytes of one block: K and V of every layer for block_size tokens of num_kv_heads heads
    (a tensor-parallel rank's own KV heads)."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype.itemsize


def num_kv_blocks(
    model, config: EngineConfig, max_model_len: int, device: torch.device, block_bytes: int
) -> int:
    """The number of blocks to allocate on `device` (see the module docstring). On GPU this
    runs the model once (with tensor parallel: on every rank together)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        return _profile_gpu_blocks(model, config, max_model_len, device, block_bytes)
    budget = int(config.cpu_kv_cache_gb * 2**30) // block_bytes
    # No point holding more than every sequence at full length.
    needed = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget, needed))


@torch.inference_mode()
def _profile_gpu_blocks(
    model, config: EngineConfig, max_model_len: int, device: torch.device, block_bytes: int
) -> int:
    """Blocks that fit in gpu_memory_utilization x total after weights and a peak step."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len * 4)
    lengths = []
    while sum(lengths) < num_tokens:
        lengths.append(min(max_model_len, num_tokens - sum(lengths)))
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    hidden = model(ids, pos, AttentionContext.for_prompts(lengths, device))
    logits = model.compute_logits(hidden[: config.max_num_seqs])
    if logits is not None:  # None on tensor-parallel ranks > 0
        logits.float()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    del hidden, logits
    torch.cuda.empty_cache()
    budget = min(int(total * config.gpu_memory_utilization) - peak, free)
    return max(0, budget // block_bytes)
