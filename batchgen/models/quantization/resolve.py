"""load_plan: the LoadPlan for a checkpoint's quantization_config and the `quantization` option."""

from __future__ import annotations

from batchgen.models.config import ModelConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.int4 import scheme as int4_scheme
from batchgen.models.int4.scheme import is_int4_config
from batchgen.models.moe_config import CHECKPOINT_NAMES
from batchgen.models.quantization.fp8_plan import (
    CheckpointFp8Plan,
    OnlineFp8Plan,
    check_expert_scheme,
)
from batchgen.models.quantization.plan import LoadPlan
from batchgen.models.quantization.schemes import SUPPORTED, parse
from batchgen.models.quantization.tp_blocks import check_block_split


def load_plan(
    config: ModelConfig,
    quantization: str | None = None,
    source: str = "config.json",
    tensor_parallel_size: int = 1,
) -> LoadPlan:
    """The plan for `config`'s checkpoint and the `quantization` option (None or "fp8"): the
    checkpoint's own FP8 scheme when it has a quantization_config (already FP8, so the option
    changes nothing), else online FP8 when asked, else plain loading. A 4-bit checkpoint's
    config is checked here (the option must be unset) and gets the plain plan: the loader
    swaps in models.int4's Int4LoadPlan once check_checkpoint has read its tensors.

    Raises:
        ModelLoadError: a quantization_config batchgen does not run, naming what it found and
            what is supported; a 4-bit checkpoint of a mixture-of-experts model; a
            tensor_parallel_size that cuts a checkpoint's weight blocks
            (tp_blocks.py). Raised from the config alone, before any model is built.
    """
    if quantization not in (None, "fp8"):
        raise ModelLoadError(f"quantization={quantization!r}: expected null or fp8")
    if (
        config.moe is not None
        and config.quantization_config
        and is_int4_config(config.quantization_config)
    ):
        raise ModelLoadError(
            f"{source}: a 4-bit checkpoint of a mixture-of-experts model "
            f"({config.architecture}) is not supported: its experts run FP8 or 16-bit weights"
        )
    qc = config.quantization_config
    if qc and is_int4_config(qc):  # 4-bit: the loader's Int4LoadPlan (it needs the headers)
        if quantization is not None:
            raise ModelLoadError(
                f"{source}: quantization={quantization!r} with a 4-bit {qc.get('quant_method')} "
                "checkpoint: its weights are quantized already; leave quantization unset"
            )
        try:
            int4_scheme.parse(qc, source)
        except int4_scheme.UnsupportedQuantization as e:
            raise ModelLoadError(str(e)) from None
        return LoadPlan()
    method = qc.get("quant_method") if qc else None
    if qc and method not in ("compressed-tensors", "fp8"):
        raise _neither(source, f"quant_method {method!r}")
    if method == "compressed-tensors" and qc.get("format") not in (None, "float-quantized"):
        raise _neither(source, f"quant_method {method!r}, format {qc.get('format')!r}")
    if config.quantization_config:
        scheme = parse(config.quantization_config, source)
        check_block_split(config, scheme, tensor_parallel_size, source)
        _check_experts(config, scheme, source)
        return CheckpointFp8Plan(scheme, source) if scheme.groups else LoadPlan()
    return OnlineFp8Plan() if quantization == "fp8" else LoadPlan()


def _check_experts(config: ModelConfig, scheme, source: str) -> None:
    """Static input scales on a MoE model's experts are refused from the config alone (the
    load plan refuses them too, and mixed schemes, once it sees every expert's name)."""
    if config.moe is None:
        return
    block, (gate, _, _) = CHECKPOINT_NAMES[config.architecture]
    layers = [i for i, sparse in enumerate(config.moe.sparse_layers) if sparse]
    expert = (
        scheme.scheme_of(f"model.layers.{layers[0]}.{block}.experts.0.{gate}") if layers else None
    )
    if expert is not None:
        check_expert_scheme(expert, source, config.architecture)


def _neither(source: str, what: str) -> ModelLoadError:
    """A quantization_config neither the FP8 nor the 4-bit loader reads."""
    return ModelLoadError(
        f"{source}: quantization_config {what} is not supported; supported: {SUPPORTED}; "
        f"{int4_scheme.SUPPORTED}"
    )
