"""Int4LoadPlan: what the loader does for a 4-bit checkpoint around loading the weights (a
batchgen.models.quantization LoadPlan).

The model is built on meta (`build_device`); `prepare(model)` swaps each projection the checkpoint
stores in 4 bits for an Int4Linear on the device (fused q/k/v and gate/up stay fused: all of
their parts must be 4-bit) and allocates the rest there; `tensors(stream)` passes the
16-bit tensors on to the loader and keeps each module's format tensors until the module is
complete, then converts it (on the model's device) into the packed layout; a fused projection is
set once all its parts are converted, concatenated along the output dim; `finish(model)` checks
that every 4-bit projection was filled and no format tensor was left over. K/V-cache scales
a checkpoint carries are taken and set as for any LoadPlan.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from batchgen.distributed.partition import RowBlock
from batchgen.layers.int4_linear import Int4Linear, PackedInt4, concat_outputs
from batchgen.models.errors import ModelLoadError
from batchgen.models.int4 import awq, compressed_tensors, gptq
from batchgen.models.int4.checkpoint import Int4Checkpoint
from batchgen.models.int4.materialize import materialize_
from batchgen.models.int4.tp_slices import format_slice
from batchgen.models.quantization.plan import LoadPlan


def projections(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """(our name, module, its HF module names in shard order) of every nn.Linear; a tied LM
    head (the embedding table) is left out."""
    inverse: dict[str, list[str]] = {}
    for hf_part, (ours, shard) in model.packed_modules.items():
        inverse.setdefault(ours, [""] * len(model.shard_sizes(ours)))[shard] = hf_part
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (tied and name == "lm_head"):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = inverse.get(leaf)
        out.append((name, module, [f"{prefix}.{p}" for p in parts] if parts else [name]))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class Int4LoadPlan(LoadPlan):
    """Loads a checkpoint's 4-bit projections into Int4Linear layers on `device`."""

    def __init__(self, checkpoint: Int4Checkpoint, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.ckpt = checkpoint
        self.device, self.dtype = device, dtype
        self.model: nn.Module | None = None
        self.k_blocks: dict[str, RowBlock] = {}  # HF module -> its input columns (row-parallel)
        self.layers: dict[str, Int4Linear] = {}  # our module name -> its layer
        self.shards: dict[str, tuple[str, int]] = {}  # HF module -> (our module, shard)
        self.parts: dict[str, list[PackedInt4 | None]] = {}  # our module -> converted parts
        self.stash: dict[str, dict[str, torch.Tensor]] = {}  # HF module -> suffix -> tensor

    def build_device(self, device: torch.device) -> torch.device:
        return torch.device("meta")  # a 70B model's 16-bit projections would need 140 GB

    def prepare(self, model: nn.Module) -> None:
        """Replace every projection the checkpoint stores in 4 bits with an Int4Linear, then
        allocate the rest of the (meta) model on the device."""
        src = self.ckpt.source
        self.model = model
        for name, linear, hf_names in projections(model):
            four = [h for h in hf_names if h in self.ckpt.modules]
            if not four:
                continue
            if len(four) != len(hf_names):
                plain = [h for h in hf_names if h not in self.ckpt.modules]
                raise ModelLoadError(
                    f"{src}: {', '.join(four)} {'is' if len(four) == 1 else 'are'} 4-bit but "
                    f"{', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not; batchgen runs "
                    "them as one fused projection, which needs all of them 4-bit"
                )
            layer = Int4Linear(
                linear.in_features, linear.out_features, linear.bias is not None,
                device=self.device, dtype=self.dtype,
            )  # fmt: skip
            _replace(model, name, layer)
            self.layers[name] = layer
            self.parts[name] = [None] * len(hf_names)
            for i, h in enumerate(hf_names):
                self.shards[h] = (name, i)
        unplaced = sorted(set(self.ckpt.modules) - set(self.shards))
        if unplaced:
            raise ModelLoadError(
                f"{src}: the checkpoint stores {', '.join(unplaced)} in 4 bits, but this model "
                "runs it in 16 bits"
            )
        materialize_(model, self.device, model.config)

    def tp_select(self, select):
        return self.tp_slice  # the model's blocks, in each format tensor's own units

    def tp_slice(self, hf_name: str) -> tuple[int, RowBlock] | None:
        """A tensor-parallel rank's block of checkpoint tensor hf_name: the model's for 16-bit
        tensors, the matching block of a 4-bit module's format tensors (tp_slices.py)."""
        module, _, suffix = hf_name.rpartition(".")
        if module not in self.shards or suffix not in self.ckpt.scheme.suffixes:
            return self.model.tp_slice(hf_name)
        part = self.model.tp_slice(module + ".weight")
        if part is None:
            return None
        dim, block = part
        if dim == 1:
            self.k_blocks[module] = block
        n = self.ckpt.modules[module][0]
        info = self.ckpt.tensors.get(hf_name)
        unpacked = info is not None and info.shape[0] == n  # a zero point stored [N, G]
        try:
            return format_slice(
                self.ckpt.scheme.method, suffix, dim, block, self.ckpt.scheme.group_size, unpacked
            )
        except ValueError as e:
            raise ModelLoadError(
                f"{self.ckpt.source}: tensor parallel cannot split {module}: {e}"
            ) from None

    def tensors(self, stream) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The stream without the format's tensors (which convert the modules as they
        complete) and K/V-cache scales."""
        return self.kv_scales.take(self._plain(stream))

    def _plain(self, stream) -> Iterator[tuple[str, str, torch.Tensor]]:
        suffixes = self.ckpt.scheme.suffixes
        for file, name, tensor in stream:
            module, _, suffix = name.rpartition(".")
            if module not in self.shards or suffix not in suffixes:
                yield file, name, tensor
                continue
            held = self.stash.setdefault(module, {})
            held[suffix] = tensor.to(self.device)
            if self._complete(module, held):
                self._convert(file, module, self.stash.pop(module))

    def _complete(self, module: str, held: dict[str, torch.Tensor]) -> bool:
        scheme = self.ckpt.scheme
        optional = {s for s in scheme.suffixes if f"{module}.{s}" in self.ckpt.tensors}
        return all(s in held for s in set(scheme.required) | optional)

    def _convert(self, file: str, module: str, held: dict[str, torch.Tensor]) -> None:
        scheme = self.ckpt.scheme
        ours, shard = self.shards[module]
        layer = self.layers[ours]
        sizes = (
            self.model.shard_sizes(ours.rpartition(".")[2]) if len(self.parts[ours]) > 1 else None
        )
        shape = (sizes[shard] if sizes else layer.out_features, layer.in_features)  # this rank's
        try:
            if module in self.k_blocks:
                self._local_groups(module, held)
            if scheme.method == "gptq":
                packed = gptq.to_packed(held, scheme.group_size, scheme.v1_zeros, module)
            elif scheme.method == "awq":
                packed = awq.to_packed(held, scheme.group_size, module)
            else:
                packed = compressed_tensors.to_packed(
                    held, scheme.group_size, scheme.symmetric, module, shape
                )
        except ValueError as e:
            raise ModelLoadError(f"{file}: {e}") from None
        parts = self.parts[ours]
        parts[shard] = packed
        if all(p is not None for p in parts):
            layer = self.layers[ours]
            try:
                fused = concat_outputs(parts, ours) if len(parts) > 1 else parts[0]
                layer.set_packed(fused)
            except ValueError as e:
                raise ModelLoadError(f"{self.ckpt.source}: {e}") from None
            self.parts[ours] = []  # done; the layer holds the tensors

    def _local_groups(self, module: str, held: dict[str, torch.Tensor]) -> None:
        """A row-parallel rank's g_idx covers its input columns only: it must list them in
        group order (then it is dropped: the local layout is plain), since an act order spreads
        each group's channels over every rank."""
        block = self.k_blocks[module]
        for key in ("g_idx", "weight_g_idx"):
            g_idx = held.pop(key, None)
            if g_idx is None:
                continue
            size = self.ckpt.modules[module][1] if self.ckpt.scheme.group_size == -1 else (
                self.ckpt.scheme.group_size
            )  # fmt: skip
            plain = torch.arange(block.start, block.start + block.length, device=g_idx.device)
            if not torch.equal(g_idx.long(), plain // size):
                raise ValueError(
                    f"{module}.{key}: an act-order (desc_act) checkpoint cannot be split across "
                    "tensor-parallel ranks (each group's input channels are spread over all of "
                    "them); run it with tensor_parallel_size 1"
                )

    def finish(self, model: nn.Module) -> None:
        """Every 4-bit projection filled, no format tensor left over."""
        if self.stash:
            module, held = next(iter(self.stash.items()))
            raise ModelLoadError(
                f"{self.ckpt.source}: {module} is missing some of its {self.ckpt.scheme.method} "
                f"tensors (has {', '.join(sorted(held))})"
            )
        empty = [name for name, parts in self.parts.items() if parts]
        if empty:
            raise ModelLoadError(f"{self.ckpt.source}: 4-bit tensors missing for {empty[0]}")
        super().finish(model)
