"""Build a model from a Hugging Face directory: config, class from the registry, fused weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchgen.distributed.group import TensorParallel
from batchgen.models.checkpoint_check import check_checkpoint
from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.int4.plan import Int4LoadPlan
from batchgen.models.quantization import load_plan
from batchgen.models.registry import model_class
from batchgen.models.weight_files import find_weight_files
from batchgen.models.weights import iter_tensors

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """ "auto": float32 on CPU (fast and exact there); on GPU the checkpoint's half dtype, else
    bfloat16."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return (
        _DTYPES.get(config.torch_dtype or "", torch.bfloat16)
        if config.torch_dtype in ("bfloat16", "float16")
        else torch.bfloat16
    )


def build_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None
) -> nn.Module:
    """An uninitialized-but-allocated model of the right class (random weights from nn init);
    with `tp`, only this rank's share of it."""
    cls = model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config, tp) if tp is not None else cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_model(
    path: str,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Load config and weights of `path` onto `device`; with `tp`, this rank's share only,
    read slice by slice from the safetensors files (model.tp_slice says which). Quantized
    checkpoints (and the `quantization` option) load through batchgen.models.quantization.

    Raises:
        ModelLoadError: naming the file or tensor at fault and what was expected.
    """
    config = ModelConfig.from_dir(path)
    # A quantization_config (or option) batchgen cannot run is refused by name first; then the
    # weights' headers are checked against the config before the model it describes is built.
    size = tp.size if tp is not None else 1
    plan = load_plan(config, quantization, f"{path}/config.json", size)
    int4 = check_checkpoint(path, config, allow_pickle, size)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config, device)
    if int4 is not None:  # 4-bit projections: built on meta, never allocated in 16 bits
        plan = Int4LoadPlan(int4, device, dtype)
    model = build_model(config, dtype, plan.build_device(device), tp)
    plan.prepare(model)
    files = find_weight_files(path, allow_pickle)
    select = plan.tp_select(model.tp_slice) if tp is not None else None
    load_weights(model, plan.tensors(iter_tensors(files, select)))
    plan.finish(model)
    return model, config


@dataclass(frozen=True)
class CheckpointLoader:
    """Builds the model of a checkpoint directory on a device (a tensor-parallel rank's share
    with `tp`): what the engine's ranks each call, picklable so rank 0 can send it to them."""

    path: str
    dtype: str = "auto"
    allow_pickle: bool = False
    quantization: str | None = None

    def __call__(self, device: torch.device, tp: TensorParallel | None = None) -> nn.Module:
        model, _ = load_model(
            self.path, self.dtype, device, self.allow_pickle, tp, self.quantization
        )
        return model


def load_weights(model: nn.Module, tensors) -> None:
    """Copy (file, HF name, tensor) triples into the model, fusing packed projections (and
    stacking per-expert tensors, for models that say how: see _our_name and _shard_sizes).

    Every parameter (and every shard of a fused one) must be filled exactly once.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    needed: set[tuple[str, int]] = set()
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        sizes = _shard_sizes(model, name)
        needed.update((name, i) for i in range(len(sizes) if sizes else 1))
    filled: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    for file, hf_name, tensor in tensors:
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue  # derived buffers / tied copies some checkpoints carry
        name, shard = _our_name(model, hf_name)
        if name not in params:
            unexpected.append(hf_name)
            continue
        param = params[name]
        target = param.data
        if shard is not None:
            sizes = _shard_sizes(model, name)
            offset = sum(sizes[:shard])
            if target.dim() == 3:  # stacked experts [E, R, C]: shards are rows of [E * R, C]
                target = target.flatten(0, 1)
            target = target.narrow(0, offset, sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{file}: tensor {hf_name!r} has shape {tuple(tensor.shape)} but the model "
                f"expects {tuple(target.shape)} (from config.json); the config and weights "
                "do not belong together"
            )
        with torch.no_grad():
            target.copy_(tensor)
        filled.add((name, shard or 0))
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} tensor(s) this {model.config.architecture} model "
            f"does not use: {shown}"
        )
    missing = sorted(needed - filled)
    if missing:
        shown = ", ".join(f"{n}[{s}]" if s else n for n, s in missing[:8])
        raise ModelLoadError(
            f"checkpoint is missing {len(missing)} tensor(s): {shown}"
            + (" ..." if len(missing) > 8 else "")
        )


def _shard_sizes(model: nn.Module, name: str) -> list[int] | None:
    """Row counts of the checkpoint tensors parameter `name` is fused from, in order (None: one
    tensor). A model's own param_shard_sizes(name) answers first where it has one."""
    own = getattr(model, "param_shard_sizes", None)
    sizes = own(name) if own is not None else None
    if sizes is not None:
        return sizes
    fused = next((f for f, _ in model.packed_modules.values() if f"{f}." in name), None)
    return model.shard_sizes(fused) if fused else None


def _our_name(model: nn.Module, hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, shard index within a fused parameter or None).
    A model's own checkpoint_name(hf_name) answers first where it has one."""
    own = getattr(model, "checkpoint_name", None)
    mapped = own(hf_name) if own is not None else None
    if mapped is not None:
        return mapped
    for hf_part, (ours, shard) in model.packed_modules.items():
        if f".{hf_part}." in hf_name:
            return hf_name.replace(f".{hf_part}.", f".{ours}."), shard
    return hf_name, None
