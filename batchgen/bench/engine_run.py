"""Our engine on a workload: build it (random preset or HF dir), warm up, time the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from batchgen.bench.gpu_power import PowerSampler, device_uuid
from batchgen.bench.random_int4 import RandomInt4Preset, build_random_int4_model
from batchgen.bench.random_model import RandomPreset, build_random_model, preset_config
from batchgen.bench.timing import timed
from batchgen.bench.workloads import Workload, warmup_workload
from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.model_runner import ModelRunner, resolve_device
from batchgen.models.config import ModelConfig
from batchgen.models.loader import resolve_dtype
from batchgen.models.quantization import load_plan
from batchgen.models.tokenizer import Tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

PRESET_MODEL = "<random preset>"  # EngineConfig.model of a preset run (never read from disk)


@dataclass
class Bench:
    """The model under test: a runner to build fresh engines on, plus where it came from."""

    config: EngineConfig
    runner: ModelRunner
    hf_config: dict[str, Any] | None  # the preset's config dict; None for a model dir
    model_path: str | None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def engine(self, tokenizer: Tokenizer | None = None, **overrides: Any) -> LLMEngine:
        """A fresh engine (empty prefix cache, zeroed stats) over the shared runner and cache;
        `tokenizer` for work that needs one (structured output over a random preset)."""
        return LLMEngine(replace(self.config, **overrides), runner=self.runner, tokenizer=tokenizer)


def build_bench(
    config: EngineConfig,
    preset: str | None,
    model_path: str | None,
    max_model_len: int,
    int4: tuple[int, bool] | None = None,
) -> Bench:
    """Load `model_path`, or build `preset` with random weights directly on the device (then
    quantized to FP8 with config.quantization fp8; with int4 = (group size, act order), its
    projections as random 4-bit GPTQ tensors).

    Raises:
        ModelLoadError: the preset cannot take config.quantization (before anything is built).
    """
    if model_path is not None:
        engine = LLMEngine(replace(config, model=model_path, max_model_len=max_model_len))
        return Bench(engine.config, engine.runner, None, model_path)
    device = resolve_device(config.device)
    raw = preset_config(preset)
    mc = ModelConfig.from_dict(raw, source=f"preset {preset}")
    plan = load_plan(mc, config.quantization, f"--model-preset {preset}")  # refusals first
    dtype = resolve_dtype(config.dtype, mc, device)
    config = replace(config, model=PRESET_MODEL, max_model_len=max_model_len)
    if config.tensor_parallel_size > 1:  # every rank builds its share on its own GPU
        build = (
            RandomInt4Preset(preset, dtype, config.seed, *int4)
            if int4 is not None
            else RandomPreset(preset, dtype, config.seed, config.quantization)
        )
        return Bench(config, ModelRunner(config, mc, max_model_len, build=build), raw, None)
    if int4 is not None:
        model, raw = build_random_int4_model(preset, dtype, device, config.seed, *int4)
    else:
        model, raw = build_random_model(preset, dtype, device, seed=config.seed)
        plan.finish(model)  # online FP8 of the random weights with quantization fp8
    runner = ModelRunner.from_model(config, model, max_model_len)
    return Bench(config, runner, raw, None)


@dataclass
class RunResult:
    """Counters of one timed run (engine stats accrued during the timed phase only)."""

    wall_s: float
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    candidate_tokens: int
    preemptions: int
    steps: int
    errors: int
    # The GPU during the timed run (gpu_power.summarize), {"error": why} where it could not be
    # sampled on CUDA, None off CUDA.
    gpu: dict[str, Any] | None = None
    # Structured output's host work in the timed run (None when nothing was constrained):
    # seconds filling token masks, steps that filled them, constrained rows filled.
    masks: dict[str, Any] | None = None
    # Mixture-of-experts models: experts the steps' real tokens reached, summed over steps and
    # sparse layers (the MoE roofline's expert reads); None for dense models.
    experts_touched: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def submit(
    engine: LLMEngine,
    w: Workload,
    prefix: str,
    seed: int = 0,
    ignore_eos: bool = True,
    **sampling: Any,
) -> None:
    """Queue every request of `w` (seeded per request so runs are reproducible); `sampling`:
    more SamplingParams fields for the generation requests (e.g. a penalty). With ignore_eos
    (the default) each request generates exactly its max_tokens."""
    for i, prompt in enumerate(w.prompts):
        rid = f"{prefix}{i}"
        if w.candidates is not None:
            engine.add_score_request(rid, prompt, w.candidates[i])
        else:
            params = SamplingParams(
                max_tokens=w.max_tokens[i],
                temperature=w.temperature,
                ignore_eos=ignore_eos,
                seed=seed + i,
                **sampling,
            )
            engine.add_request(rid, prompt, params)


def drain(engine: LLMEngine, outputs: dict[str, RequestOutput] | None = None) -> int:
    """Step until every request finished; returns the number of error outputs. `outputs`, when
    given, receives each finished request's output by id."""
    errors = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            errors += out.error is not None
            if outputs is not None:
                outputs[out.request_id] = out
    return errors


def warm_up(
    engine: LLMEngine, w: Workload, count: int = 16, fill_step: bool = True, **submit_kw: Any
) -> None:
    """Run `count` look-alike requests of `w` to the end; fill_step: more, until their prompts
    hold one full step of the engine's max_num_batched_tokens (the timed run's first admission
    then meets no activation size for the first time). submit_kw: as the timed run's."""
    budget = engine.config.max_num_batched_tokens if fill_step else 0
    look_alike = warmup_workload(w, engine.model_config.vocab_size, count, budget)
    submit(engine, look_alike, "warmup-", **submit_kw)
    drain(engine)


def run_engine(
    bench: Bench,
    w: Workload,
    warmup: int = 16,
    tokenizer: Tokenizer | None = None,
    submit_kw: dict[str, Any] | None = None,
    outputs: dict[str, RequestOutput] | None = None,
    sync: Callable[[], None] | None = None,
    **overrides: Any,
) -> RunResult:
    """Warm up with `warmup` look-alike requests, then time `w` on a fresh engine.

    submit_kw: `submit`'s ignore_eos and SamplingParams fields, for warm-up and timed run;
    outputs: receives the timed requests' outputs by id (request i is "i"); sync: called
    right before the clock starts (data parallel: the processes start together)."""
    engine = bench.engine(tokenizer, **overrides)
    submit_kw = submit_kw or {}
    if warmup:
        warm_up(engine, w, warmup, **submit_kw)
    before = dataclasses.replace(engine.stats)
    masks_before = _mask_counters(engine)
    counter = getattr(bench.runner.model, "expert_counter", None)
    touched_before = counter.read() if counter is not None else 0

    def go() -> int:
        submit(engine, w, "", **submit_kw)
        return drain(engine, outputs)

    if sync is not None:
        sync()

    with PowerSampler(device_uuid(bench.device)) as power:
        wall, errors = timed(go, bench.device)
    gpu = power.summary
    if gpu is None and bench.device.type == "cuda":
        gpu = {"error": power.error}
    s = engine.stats
    return RunResult(
        wall_s=wall,
        requests=s.num_requests - before.num_requests,
        prompt_tokens=s.num_prompt_tokens - before.num_prompt_tokens,
        cached_tokens=s.num_cached_tokens - before.num_cached_tokens,
        output_tokens=s.num_generated_tokens - before.num_generated_tokens,
        candidate_tokens=s.num_scored_tokens - before.num_scored_tokens,
        preemptions=s.num_preemptions - before.num_preemptions,
        steps=s.num_steps - before.num_steps,
        errors=errors,
        gpu=gpu,
        masks=_mask_delta(masks_before, _mask_counters(engine)),
        experts_touched=counter.read() - touched_before if counter is not None else None,
    )


def _mask_counters(engine: LLMEngine) -> tuple[float, int, int] | None:
    s = engine.structured
    return None if s is None else (s.fill_seconds, s.steps_filled, s.rows_filled)


def _mask_delta(before, after) -> dict[str, Any] | None:
    if after is None:
        return None
    seconds, steps, rows = (a - b for a, b in zip(after, before or (0.0, 0, 0)))
    if not steps:
        return None
    return {
        "seconds": seconds,
        "steps": steps,
        "rows": rows,
        "ms_per_step": 1e3 * seconds / steps,
        "us_per_row": 1e6 * seconds / max(rows, 1),
    }
