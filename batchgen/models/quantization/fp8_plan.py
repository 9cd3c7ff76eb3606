"""Load plans for FP8 weights: a published FP8 checkpoint (CheckpointFp8Plan) and online FP8 of a
16-bit checkpoint (OnlineFp8Plan, `quantization: fp8`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from batchgen.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, quantize_fp8_ref
from torch import nn

from batchgen.distributed.partition import RowBlock
from batchgen.layers.fp8_linear import Fp8Linear, Fp8Scheme, dequantized_weight
from batchgen.layers.moe import Fp8FusedExperts, FusedExperts, SparseMoeBlock
from batchgen.models.errors import ModelLoadError
from batchgen.models.moe_config import CHECKPOINT_NAMES
from batchgen.models.quantization.plan import LoadPlan
from batchgen.models.quantization.schemes import CheckpointScheme

_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")
# The decoder's projections online FP8 quantizes (lm_head and the embedding stay 16-bit).
ONLINE_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    tied = getattr(model.config, "tie_word_embeddings", False)
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not (tied and name == "lm_head")
    ]


def check_expert_scheme(scheme: Fp8Scheme, source: str, where: str) -> None:
    """MoE experts take dynamic activation scales (or none): static input scales are refused."""
    if scheme.activation == "tensor":
        raise ModelLoadError(
            f"{source}: static (per-tensor) input scales on the experts of {where} are not "
            "supported; dynamic per-token or per-group activations are"
        )


class CheckpointFp8Plan(LoadPlan):
    """A checkpoint with FP8 projections: they become Fp8Linear before loading; their FP8 weights
    load through the loader (fused shards included), their scales through this plan (per-tensor
    scales expanded to every row of their shard, exactly; shards' scales concatenated)."""

    def __init__(self, scheme: CheckpointScheme, source: str) -> None:
        super().__init__()
        self.scheme, self.source = scheme, source
        self.shards: dict[str, tuple[str, int, int]] = {}  # HF module -> (ours, shard, rows)
        self.layers: dict[str, Fp8Linear] = {}
        # HF expert module -> (our Fp8FusedExperts, expert, "gate" | "up" | "down", rows)
        self.expert_shards: dict[str, tuple[str, int, str, int]] = {}
        self.stash: dict[tuple[str, str], torch.Tensor] = {}  # (HF module, suffix) -> tensor

    def prepare(self, model: nn.Module) -> None:
        # MoE routers stay 16-bit, whatever the config's targets say (checkpoints store them so).
        routers = {f"{n}.gate" for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
        inverse: dict[str, list[str]] = {}
        for hf_part, (ours, shard) in model.packed_modules.items():
            inverse.setdefault(ours, [""] * len(model.shard_sizes(ours)))[shard] = hf_part
        for name, linear in _linears(model):
            if name in routers:
                continue
            prefix, _, leaf = name.rpartition(".")
            parts = inverse.get(leaf)
            hf_names = [f"{prefix}.{p}" for p in parts] if parts else [name]
            rows = model.shard_sizes(leaf) if parts else [linear.out_features]
            schemes = {self.scheme.scheme_of(h) for h in hf_names}
            if len(schemes) > 1:
                raise ModelLoadError(
                    f"{self.source}: {', '.join(hf_names)} are fused into one projection but "
                    "quantization_config gives them different schemes (or ignores only some)"
                )
            scheme = schemes.pop()
            if scheme is None:
                continue
            self._check_blocks(hf_names, rows, scheme)
            layer = Fp8Linear(
                linear.in_features, linear.out_features, linear.bias is not None, scheme,
                device=linear.weight.device, dtype=linear.weight.dtype,
            )  # fmt: skip
            _replace(model, name, layer)
            self.layers[name] = layer
            for shard, (hf, n) in enumerate(zip(hf_names, rows)):
                self.shards[hf] = (name, shard, n)
        for name, experts in list(model.named_modules()):
            if isinstance(experts, FusedExperts):
                self._prepare_experts(model, name, experts)

    def _prepare_experts(self, model: nn.Module, name: str, experts: FusedExperts) -> None:
        """A MoE layer's stacked experts become Fp8FusedExperts when the checkpoint quantizes
        its per-expert projections (all alike; static activation scales are refused)."""
        block, (gate, up, down) = CHECKPOINT_NAMES[model.config.architecture]
        layer = name.rpartition(".mlp.")[0]
        e, two_i, h = experts.gate_up_proj.shape
        parts = {gate: ("gate", two_i // 2), up: ("up", two_i // 2), down: ("down", h)}
        hf_names = {
            f"{layer}.{block}.experts.{i}.{proj}": (i, *parts[proj])
            for i in range(e)
            for proj in (gate, up, down)
        }
        schemes = {self.scheme.scheme_of(hf) for hf in hf_names}
        if schemes == {None}:
            return  # the experts stay 16-bit
        if len(schemes) > 1:
            raise ModelLoadError(
                f"{self.source}: quantization_config gives the experts of {layer} different "
                "schemes (or ignores only some); batchgen stacks them into one FP8 tensor"
            )
        scheme = schemes.pop()
        check_expert_scheme(scheme, self.source, layer)
        fp8 = Fp8FusedExperts(e, h, two_i // 2, scheme, device=experts.gate_up_proj.device)
        _replace(model, name, fp8)
        for hf, (i, part, rows) in hf_names.items():
            self.expert_shards[hf] = (name, i, part, rows)

    def _quantized(self, module: str) -> bool:
        return module in self.shards or module in self.expert_shards

    def _check_blocks(self, hf_names: list[str], rows: list[int], scheme: Fp8Scheme) -> None:
        if scheme.weight != "block":
            return
        for hf, n in zip(hf_names[:-1], rows[:-1]):
            if n % scheme.block[0]:
                raise ModelLoadError(
                    f"{self.source}: {hf} has {n} output rows, not a multiple of the weight "
                    f"block's {scheme.block[0]}, so its block scales cannot be fused with the "
                    f"next projection's ({hf_names[-1]})"
                )

    def tp_select(self, select):
        """Scales sliced with their weight: per-channel rows with a column-parallel weight's
        rows; block scales by whole blocks (a rank's rows or columns must be whole blocks);
        per-tensor and static input scales whole."""

        def pick(name: str):
            module, _, suffix = name.rpartition(".")
            if not self._quantized(module) or suffix not in _SCALE_SUFFIXES:
                return select(name)
            part = select(module + ".weight")
            strategy = self.scheme.strategy_of(module)
            if part is None or suffix == "input_scale" or strategy == "tensor":
                return None
            dim, block = part
            if strategy == "channel":
                return part if dim == 0 else None  # o / down keep every output row
            size = self.scheme.scheme_of(module).block[dim]
            whole = block.start % size == 0 and (
                block.length % size == 0 or block.start + block.length == block.full
            )
            if not whole:
                raise ModelLoadError(
                    f"{self.source}: with tensor parallel a rank holds "
                    f"{'rows' if dim == 0 else 'columns'} [{block.start}, "
                    f"{block.start + block.length}) of {module}, not whole {size}-wide weight "
                    "blocks; choose a tensor_parallel_size that splits it into whole blocks"
                )
            blocks = -(-block.full // size)
            return dim, RowBlock(block.start // size, -(-block.length // size), blocks)

        return pick

    def tensors(self, stream) -> Iterator[tuple[str, str, torch.Tensor]]:
        for file, name, tensor in super().tensors(stream):
            module, _, suffix = name.rpartition(".")
            if suffix in ("weight_zero_point", "input_zero_point"):
                raise ModelLoadError(
                    f"{file}: {name}: asymmetric FP8 (zero points) is not supported"
                )
            if suffix in _SCALE_SUFFIXES and self._quantized(module):
                self.stash[(module, suffix)] = tensor
                continue
            if suffix == "weight" and tensor.dtype == FP8_DTYPE and not self._quantized(module):
                raise ModelLoadError(
                    f"{file}: {name} is FP8, but quantization_config leaves {module} "
                    "unquantized (ignore / modules_to_not_convert)"
                )
            if suffix == "weight" and self._quantized(module) and tensor.dtype != FP8_DTYPE:
                raise ModelLoadError(
                    f"{file}: {name} is {tensor.dtype}; quantization_config makes {module} FP8, "
                    f"whose weight must be {FP8_DTYPE}"
                )
            yield file, name, tensor

    def finish(self, model: nn.Module) -> None:
        super().finish(model)
        by_layer: dict[str, list[tuple[str, int]]] = {}
        for hf, (ours, _, n) in sorted(self.shards.items(), key=lambda kv: kv[1]):
            by_layer.setdefault(ours, []).append((hf, n))
        for ours, shards in by_layer.items():
            layer = self.layers[ours]
            scales = [self._weight_scale(hf, n, layer.scheme) for hf, n in shards]
            layer.weight_scale.copy_(torch.cat(scales))
            if layer.scheme.activation == "tensor":
                # Fused shards see the same input; calibrations give them equal scales. Where
                # they differ the largest is used, so no shard's input saturates earlier.
                inputs = [self._take(hf, "input_scale").float().reshape(-1) for hf, _ in shards]
                layer.input_scale.copy_(torch.stack([t.max() for t in inputs]).max().reshape(1))
            if layer.scheme.activation is None and layer.weight.is_cuda:
                _replace(model, ours, _dequantized_linear(layer))
        self._finish_experts(model)
        left = sorted(f"{m}.{s}" for m, s in self.stash)
        if left:
            raise ModelLoadError(
                f"{self.source}: unexpected quantization tensors: {', '.join(left)}"
            )

    def _finish_experts(self, model: nn.Module) -> None:
        """Each expert's gate / up / down scales into its rows of the stacked scale tensors
        (gate rows then up rows; with block scales each keeps its own block rows)."""
        for hf, (ours, e, part, rows) in sorted(self.expert_shards.items()):
            experts = model.get_submodule(ours)
            scale = self._weight_scale(hf, rows, experts.scheme)
            if part == "down":
                experts.down_scale[e].copy_(scale)
                continue
            half = experts.gate_up_scale.shape[1] // 2  # I rows, or ceil(I / bn) block rows
            lo = 0 if part == "gate" else half
            experts.gate_up_scale[e, lo : lo + half].copy_(scale)

    def _take(self, hf: str, suffix: str) -> torch.Tensor:
        tensor = self.stash.pop((hf, suffix), None)
        if tensor is None:
            raise ModelLoadError(f"{self.source}: the checkpoint lacks {hf}.{suffix}")
        return tensor

    def _weight_scale(self, hf: str, rows: int, scheme: Fp8Scheme) -> torch.Tensor:
        """One shard's scales as the layer holds them: [rows] (channel) or its block rows."""
        t = self._take(hf, self.scheme.scale_name).float()
        if scheme.weight == "channel":
            if t.numel() == 1:
                return t.reshape(1).expand(rows)  # per tensor: the same scale on every row
            if t.numel() == rows:
                return t.reshape(rows)
            raise ModelLoadError(
                f"{self.source}: {hf}.{self.scheme.scale_name} has shape {tuple(t.shape)}; "
                f"expected one scale or one per output row ({rows})"
            )
        expected = -(-rows // scheme.block[0])
        if t.dim() != 2 or t.shape[0] != expected:
            raise ModelLoadError(
                f"{self.source}: {hf}.{self.scheme.scale_name} has shape {tuple(t.shape)}; "
                f"expected [{expected}, ceil(in / {scheme.block[1]})] block scales"
            )
        return t


def _dequantized_linear(layer: Fp8Linear) -> nn.Linear:
    """A weight-only FP8 layer as a 16-bit nn.Linear (float(w) * scale rounded to the
    activations' dtype): on the GPU weight-only schemes run as 16-bit GEMMs."""
    linear = nn.Linear(
        layer.in_features, layer.out_features, layer.bias is not None, layer.weight.device,
        layer.act_dtype,
    )  # fmt: skip
    with torch.no_grad():
        linear.weight.copy_(dequantized_weight(layer))
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear


def _rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], scales [..., N]): max |w| of each row / 448."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    return quantize_fp8_ref(w, scale[..., None]), scale


@torch.no_grad()
def quantize_linear(linear: nn.Linear) -> Fp8Linear:
    """Online FP8 of one projection: per-output-row scales max |w| / 448, dynamic per-token
    activations."""
    layer = Fp8Linear(
        linear.in_features, linear.out_features, linear.bias is not None,
        Fp8Scheme("channel", "token"), device=linear.weight.device, dtype=linear.weight.dtype,
    )  # fmt: skip
    q, scale = _rows_fp8(linear.weight)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    if linear.bias is not None:
        layer.bias.copy_(linear.bias)
    return layer


@torch.no_grad()
def quantize_experts(experts: FusedExperts) -> Fp8FusedExperts:
    """Online FP8 of a MoE layer's stacked experts: per-row scales (each expert's gate, up and
    down rows), dynamic per-token activations, as quantize_linear does a projection; one
    expert at a time, so the peak is one expert's fp32 copy."""
    e, two_i, h = experts.gate_up_proj.shape
    device = experts.gate_up_proj.device
    out = Fp8FusedExperts(e, h, two_i // 2, Fp8Scheme("channel", "token"), device=device)
    for i in range(e):
        for src, dst, scale in ((experts.gate_up_proj, out.gate_up_proj, out.gate_up_scale),
                                (experts.down_proj, out.down_proj, out.down_scale)):  # fmt: skip
            q, s = _rows_fp8(src[i])
            dst[i].copy_(q)
            scale[i].copy_(s)
    return out


def quantize_model_fp8(model: nn.Module) -> nn.Module:
    """Online FP8 of the decoder's projections in place, the experts of MoE layers included (one
    at a time, so the peak memory is the 16-bit model plus one projection's FP8 copy); returns
    the model."""
    for name, linear in _linears(model):
        if name.rpartition(".")[2] in ONLINE_PROJECTIONS:
            _replace(model, name, quantize_linear(linear))
    for name, experts in list(model.named_modules()):
        if isinstance(experts, FusedExperts):
            _replace(model, name, quantize_experts(experts))
    return model


class OnlineFp8Plan(LoadPlan):
    """`quantization: fp8` on a 16-bit checkpoint: load it as it is, then quantize."""

    def finish(self, model: nn.Module) -> None:
        super().finish(model)
        quantize_model_fp8(model)
