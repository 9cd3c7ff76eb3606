"""Quantized weights and K/V-cache scales at load time: what a checkpoint's `quantization_config`
(or the `quantization` engine option) asks for, as a LoadPlan the loader runs.

The loader builds the model, then `plan.prepare(model)` (quantized projections replace the
plain ones), loads `plan.tensors(stream)` (checkpoint tensors renamed, expanded or held back),
then `plan.finish(model)` (online quantization, K/V scales).
"""

from __future__ import annotations

from batchgen.models.quantization.fp8_plan import quantize_model_fp8
from batchgen.models.quantization.plan import LoadPlan
from batchgen.models.quantization.resolve import load_plan

__all__ = ["LoadPlan", "load_plan", "quantize_model_fp8"]
