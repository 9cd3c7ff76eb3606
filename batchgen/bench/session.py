"""One bench invocation: ceilings, model, workload runs, comparisons, and the report dict."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.bench import moe_roofline, roofline
from batchgen.bench.ceilings import measure_ceilings
from batchgen.bench.engine_run import Bench, build_bench, run_engine
from batchgen.bench.random_model import (
    decode_weight_bytes,
    non_embedding_params,
    parameter_bytes,
    preset_config,
)
from batchgen.bench.report import environment, hit_rates, median_run, rates
from batchgen.bench.step_roofline import StepRoofline, step_roofline
from batchgen.bench.timing import peak_memory_bytes, reset_peak_memory
from batchgen.bench.workloads import Workload, build_workload, warmup_workload
from batchgen.config import EngineConfig
from batchgen.engine.model_runner import resolve_device
from batchgen.layers.int4_linear import weight_count
from batchgen.models.config import ModelConfig


@dataclass(frozen=True)
class BenchOptions:
    workload: str
    preset: str
    model_path: str | None
    engine: EngineConfig
    peer: str | None = None
    repeat: int = 1
    peer_repeat: int = 1
    num_prompts: int | None = None
    max_output_tokens: int | None = None
    warmup: int = 16
    quantization: str | None = None  # "gptq": the preset's projections random 4-bit GPTQ
    int4_group_size: int = 128
    int4_act_order: bool = False
    structured_schema: str | None = None  # a JSON schema file: constrained run + replay
    # Data parallel (bench/data_parallel.py): this process's share of the requests (index,
    # count), and a call every process makes right before each timed run (a barrier).
    part: tuple[int, int] | None = None
    sync: Callable[[], None] | None = None


def _model_config(opts: BenchOptions) -> ModelConfig:
    if opts.model_path is not None:
        return ModelConfig.from_dir(opts.model_path)
    return ModelConfig.from_dict(preset_config(opts.preset), source=f"preset {opts.preset}")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _result(
    run: dict[str, Any],
    w: Workload,
    cost: roofline.WorkloadCost,
    ceilings: dict[str, Any],
    peak: int | None,
    ideal: StepRoofline | None = None,
    kv_tokens: int | None = None,
) -> dict[str, Any]:
    out = {**run, **hit_rates(run, w), "peak_gpu_memory_bytes": peak}
    if ideal is not None:  # the per-step roofline at the run's KV capacity
        out.update(ideal.metrics(run["wall_s"], run.get("output_tokens", 0), kv_tokens))
    out.update(
        roofline.roofline_metrics(
            cost,
            run["wall_s"],
            run.get("output_tokens", 0),
            ceilings["matmul_tflops"] * 1e12,
            ceilings["copy_tb_s"] * 1e12,
        )
    )
    out.setdefault("step_roofline_fraction", None)  # score workloads, the peer
    out.setdefault("achieved_tb_s", None)
    out.setdefault("roofline_fraction_steps_taken", None)  # mixture-of-experts models only
    out.setdefault("experts_touched_per_layer_step", None)
    out.setdefault("preemptions", None)
    out.setdefault("steps", None)
    out.setdefault("errors", None)
    out.setdefault("gpu", None)  # sampled for our engine's timed runs only
    return out


def _repeat_engine(
    bench: Bench, w: Workload, n: int, warmup: int, sync=None, **overrides
) -> list[dict]:
    return [
        rates(run_engine(bench, w, warmup, sync=sync, **overrides).as_dict(), w) for _ in range(n)
    ]


def run_bench(opts: BenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """Everything `batchgen bench` measures, as the JSON-ready report dict."""
    device = resolve_device(opts.engine.device)
    mc = _model_config(opts)
    w = build_workload(opts.workload, mc.vocab_size, opts.num_prompts, opts.max_output_tokens)
    if opts.part is not None:
        w = w.part(*opts.part)
    max_len = opts.engine.max_model_len or w.max_request_len()
    env = environment(device)
    log(f"measuring ceilings on {env['device']} ...")
    ceilings = measure_ceilings(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    reset_peak_memory(device)
    log(f"building {opts.model_path or opts.preset} on {device} ...")
    int4 = (opts.int4_group_size, opts.int4_act_order) if opts.quantization == "gptq" else None
    bench = build_bench(opts.engine, opts.preset, opts.model_path, max_len, int4)
    tuning = bench.runner.tune_report
    if tuning is not None:
        log(
            f"GEMM tuning: cuBLASLt runs {tuning.tuned} of {tuning.shapes} projection shapes "
            f"({tuning.timed} timed now, {tuning.seconds:.1f} s)"
        )
    model = bench.runner.model
    # With tensor parallel, rank 0's share: the per-rank roofline (all-reduces not counted).
    shape = roofline.model_shape(
        mc,
        non_embedding_params(model),
        parameter_bytes(model),
        bench.runner.kv_dtype.itemsize,
        model.part.num_heads,
        model.part.num_kv_heads,
    )
    # The experts' bytes in their own dtype (FP8 experts: one byte a weight).
    sparse = model.sparse_blocks() if hasattr(model, "sparse_blocks") else []
    expert_itemsize = (
        sparse[0].experts.gate_up_proj.element_size() if sparse else bench.runner.dtype.itemsize
    )
    experts = moe_roofline.expert_shape(mc, expert_itemsize, model.part.expert_intermediate_size)

    def workload_cost(wl: Workload) -> roofline.WorkloadCost:
        if experts is not None:  # a step reads the experts its tokens reach, FLOPs the active
            return moe_roofline.resident_cost(shape, experts, wl)
        return roofline.workload_cost(shape, wl)

    cost = workload_cost(w)
    kv_tokens = bench.runner.num_kv_blocks * bench.runner.block_size
    decode_bytes = decode_weight_bytes(model)

    def step_cost(wl: Workload) -> StepRoofline | None:
        if experts is not None:  # MoE steps read only the experts their tokens reach
            return None
        return step_roofline(
            shape, wl, decode_bytes, kv_tokens, bench.runner.block_size,
            ceilings["matmul_tflops"] * 1e12, ceilings["copy_tb_s"] * 1e12,
        )  # fmt: skip

    del model  # the peer frees our model; keep no reference here
    structured = None
    if opts.structured_schema is not None:
        from batchgen.bench.structured_bench import run_structured

        log(f"{w.name} with {opts.structured_schema} on every request: {w.num_requests} requests")

        def result(run: dict[str, Any], wl: Workload) -> dict[str, Any]:
            return _result(run, wl, workload_cost(wl), ceilings, peak_memory_bytes(device),
                           step_cost(wl), kv_tokens)  # fmt: skip

        structured = run_structured(
            bench, w, opts.structured_schema, opts.repeat, opts.warmup, result, log
        )
        runs = structured.pop("runs")
        w = dataclasses.replace(w, max_tokens=structured["replay"]["max_tokens"])
        cost = workload_cost(w)
    else:
        log(f"{w.name}: {w.num_requests} requests, {opts.repeat} timed run(s) ...")
        runs = _repeat_engine(bench, w, opts.repeat, opts.warmup, opts.sync)
    peak = peak_memory_bytes(device)
    report: dict[str, Any] = {
        **env,
        "workload": {
            "name": w.name,
            "num_requests": w.num_requests,
            "prompt_tokens": w.num_prompt_tokens,
            "output_tokens": w.num_output_tokens,
            "candidate_tokens": w.num_candidate_tokens,
            "shared_prefix_tokens": w.num_shared_tokens,
            "num_prompts_option": opts.num_prompts,
            "max_output_tokens_option": opts.max_output_tokens,
            "temperature": w.temperature,
            "warmup_requests": opts.warmup,
        },
        "model": {
            "name": opts.model_path or opts.preset,
            "architecture": mc.architecture,
            "weights": "checkpoint" if opts.model_path else "random normal(0, 0.02), norms 1",
            "dtype": str(bench.runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(bench.runner.kv_dtype).removeprefix("torch."),
            "parameters": weight_count(bench.runner.model),
            "non_embedding_parameters": shape.non_embedding_params,
            "weight_bytes": shape.weight_bytes,
            "quantization": opts.quantization,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "experts": dataclasses.asdict(experts) if experts is not None else None,
            "num_kv_blocks": bench.runner.num_kv_blocks,
            "max_model_len": max_len,
            # > 1: parameters, bytes and the roofline are rank 0's share.
            "tensor_parallel_size": opts.engine.tensor_parallel_size,
            "all_reduce": _all_reduce_record(bench.runner),
        },
        # As run: mixed_chunk_tokens resolved for this model when the option is None (auto).
        "engine_config": {
            **dataclasses.asdict(bench.config),
            "mixed_chunk_tokens": bench.runner.mixed_chunk_tokens,
        },
        "ceilings": ceilings,
        "gemm_tuning": dataclasses.asdict(tuning) if tuning is not None else None,
        "repeat": opts.repeat,
        "runs": runs,
        "result": _result(median_run(runs), w, cost, ceilings, peak, step_cost(w), kv_tokens),
        "prefix_caching_off": None,
        "pipeline": None,
        "peer": None,
        "structured": structured,
    }
    if structured is not None:
        report["workload"]["structured_schema"] = opts.structured_schema
    if experts is not None:
        report["result"].update(_steps_taken(shape, experts, w, report["result"], ceilings))
    if w.name == "shared-prefix":
        log("shared-prefix: the same run with prefix caching off ...")
        off = _repeat_engine(
            bench, w, opts.repeat, opts.warmup, opts.sync, enable_prefix_caching=False
        )
        off_result = _result(median_run(off), w, cost, ceilings, peak_memory_bytes(device))
        report["prefix_caching_off"] = {
            "runs": off,
            "result": off_result,
            "ratio": off_result["wall_s"] / report["result"]["wall_s"],
        }
    if w.name == "pipeline":
        report["pipeline"] = _pipeline(bench, w, opts, cost, ceilings, report, log)
    if opts.peer == "hf":
        report["peer"] = _peer(bench, w, opts, cost, ceilings, report, log)
    if bench.runner is not None:
        bench.runner.shutdown()  # tensor parallel: the worker ranks stop here
    return report


def _steps_taken(shape, experts, w, result, ceilings) -> dict[str, Any]:
    """The MoE roofline over the steps our run took (moe_roofline.steps_taken_metrics)."""
    return moe_roofline.steps_taken_metrics(
        shape, experts, w, result["steps"], result["experts_touched"], result["wall_s"],
        result.get("output_tokens", 0), ceilings["copy_tb_s"] * 1e12,
    )  # fmt: skip


def _all_reduce_record(runner) -> dict[str, Any] | None:
    """Tensor parallel: where the one-shot all-reduce replaces NCCL, and the timings behind it."""
    if runner.one_shot is None:
        return None
    limit, timings, why_off = runner.one_shot
    return {
        "one_shot_max_bytes": limit,
        "why_nccl": why_off,
        "timings_us": [{"bytes": b, "nccl": n, "one_shot": o} for b, n, o in timings],
    }


def _pipeline(bench, w, opts, cost, ceilings, report, log) -> dict[str, Any]:
    from batchgen.bench.pipeline_bench import PipelineUnavailable, run_pipeline

    log(f"pipeline: Runner end to end over {w.num_requests} JSONL rows ...")
    try:
        runs = [rates(run_pipeline(bench, w), w) for _ in range(opts.repeat)]
    except PipelineUnavailable as e:
        return {"error": str(e), "runs": [], "result": None, "overhead": None, "ratio": None}
    result = _result(median_run(runs), w, cost, ceilings, peak_memory_bytes(bench.device))
    return {
        "entry_point": "batchgen.pipeline.runner.Runner(job).run()",
        "input": "OpenAI-batch JSONL, /v1/completions, token-id prompts",
        "runs": runs,
        "result": result,
        "overhead": result["wall_s"] / report["result"]["wall_s"] - 1.0,
        "ratio": None,
    }


def _peer(bench, w, opts, cost, ceilings, report, log) -> dict[str, Any]:
    from batchgen.bench import peer_hf
    from batchgen.models.hf_export import to_hf_state_dict

    block: dict[str, Any] = {"name": "hf", "runs": [], "result": None, "ratio": None}
    if w.is_score:
        block["error"] = "transformers continuous batching has no scoring API"
        return block
    if bench.config.tensor_parallel_size > 1:
        block["error"] = "the transformers peer runs on one device (tensor_parallel_size 1)"
        return block
    log("peer hf: building the transformers model with the same weights ...")
    device, dtype = bench.device, bench.runner.dtype
    vocab_size = bench.runner.model_config.vocab_size
    try:
        state = None
        if bench.model_path is None:
            # Our weights go to host memory so our model and KV cache can be freed before the
            # peer allocates its own (both at once do not fit for 8B-class models).
            # Exported on the CPU: unfolding the norms on the GPU next to our KV cache ran out
            # of memory on llama3.1-8b.
            state = to_hf_state_dict(bench.runner.model, device="cpu")
        bench.runner = None
        _free(device)
        hf = peer_hf.build_hf_model(bench.hf_config, state, bench.model_path, dtype, device)
        del state
        for i in range(opts.peer_repeat):
            log(f"peer hf: timed run {i + 1}/{opts.peer_repeat} ...")
            warm = warmup_workload(w, vocab_size, opts.warmup)
            block["runs"].append(rates(peer_hf.run_peer(hf, w, warm, device).as_dict(), w))
    except peer_hf.PeerUnavailable as e:
        block["error"] = str(e)
        log(f"peer hf unavailable: {e}")
        return block
    run = median_run(block["runs"])
    block["result"] = _result(run, w, cost, ceilings, run.get("peak_gpu_memory_bytes"))
    block["ratio"] = report["result"]["output_tok_s"] / block["result"]["output_tok_s"]
    return block
