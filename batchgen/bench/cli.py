"""`batchgen bench`: run a standard workload, measure ceilings and roofline, optionally the peer."""

from __future__ import annotations

import sys

import click

from batchgen.bench.workloads import WORKLOADS
from batchgen.config import ConfigError, EngineConfig
from batchgen.models.errors import ModelLoadError
from batchgen.models.hub import resolve_model
from batchgen.models.presets import PRESET_NAMES


@click.command("bench")
@click.option("--workload", type=click.Choice(WORKLOADS), default="nano", show_default=True)
@click.option(
    "--model-preset",
    "preset",
    type=click.Choice(PRESET_NAMES),
    default="qwen3-0.6b",
    show_default=True,
    help="Random-weight model in this architecture, built on the device (no disk).",
)
@click.option(
    "--model",
    "model_path",
    default=None,
    help="A HF model directory or hub repo id (ORG/NAME) instead.",
)
@click.option("--revision", default=None, help="Branch, tag or commit of a hub repo id.")
@click.option("--peer", type=click.Choice(["hf"]), default=None, help="Also run this peer.")
@click.option("--repeat", default=1, show_default=True, help="Timed runs; the median is quoted.")
@click.option("--peer-repeat", default=1, show_default=True, help="Timed runs of the peer.")
@click.option("--json", "json_out", default=None, help="Write every number to this JSON file.")
@click.option(
    "--num-prompts",
    type=int,
    default=None,
    help="Scale the request count down (smoke runs); each prompt keeps its length recipe.",
)
@click.option(
    "--max-output-tokens",
    type=int,
    default=None,
    help="Cap every output length (smoke runs); the default keeps the recipe's lengths.",
)
@click.option(
    "--warmup",
    default=16,
    show_default=True,
    help="Warm-up requests before timing (look-alikes of the first ones; 16 reach a mixed step).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    default="auto",
    show_default=True,
    help="auto: bfloat16 on GPU, float32 on CPU.",
)
@click.option(
    "--quantization",
    type=click.Choice(["fp8", "gptq"]),
    default=None,
    help="fp8: the decoder's projections in FP8 e4m3 (online, per-channel weights, per-token "
    "activations); an FP8 checkpoint (--model) is detected without it. gptq: a preset's "
    "projections as random 4-bit GPTQ tensors (built on the device, converted as a "
    "checkpoint's are); a 4-bit checkpoint (--model) is detected without it.",
)
@click.option(
    "--int4-group-size",
    type=int,
    default=128,
    show_default=True,
    help="With --quantization gptq: the group size (-1: one group per output channel).",
)
@click.option(
    "--int4-act-order", is_flag=True, help="With --quantization gptq: desc_act (a random g_idx)."
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "fp8"]),
    default="auto",
    show_default=True,
    help="fp8: an e4m3 KV cache (half the bytes of bf16); the roofline counts its bytes.",
)
@click.option(
    "--calibrate-kv-scales",
    type=int,
    default=0,
    show_default=True,
    help="With --kv-cache-dtype fp8: K/V scales from the first N prompts (the warm-up's).",
)
@click.option("--enforce-eager", is_flag=True, help="Never use CUDA graphs.")
@click.option("--no-prefix-caching", is_flag=True, help="Disable prefix caching.")
@click.option(
    "--no-fold-norms", is_flag=True, help="Keep RMSNorm kernels (HF's order of roundings)."
)
@click.option(
    "--no-kn-weights", is_flag=True, help="Keep every projection weight N-major (as loaded)."
)
@click.option(
    "--no-tune-gemms",
    is_flag=True,
    help="Run every projection with cuBLAS's own pick (no cuBLASLt tuning).",
)
@click.option(
    "--tensor-parallel-size",
    type=int,
    default=1,
    show_default=True,
    help="Split the model over this many GPUs (processes on CPU); presets build each share "
    "on its own GPU.",
)
@click.option(
    "--data-parallel-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="N engines in N processes, one per GPU (or tensor-parallel group), timed together; "
    "reports the total and each GPU's output tok/s.",
)
@click.option(
    "--data-parallel-load",
    type=click.Choice(["full", "split"]),
    default="full",
    show_default=True,
    help="full: every GPU runs the whole workload (N x its requests); split: the workload's "
    "requests are dealt out over the GPUs.",
)
@click.option(
    "--disable-custom-all-reduce",
    is_flag=True,
    help="Tensor parallel: all-reduce through NCCL only (no one-shot kernel).",
)
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--admission-interval", type=int, default=None)
@click.option(
    "--mixed-chunk-tokens",
    type=int,
    default=None,
    help="Prompt tokens each decode step carries (0: off); see EngineConfig.",
)
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--num-kv-blocks", type=int, default=None)
@click.option("--block-size", type=int, default=None)
@click.option("--max-model-len", type=int, default=None, help="Default: the workload's longest.")
@click.option("--cpu-kv-cache-gb", type=float, default=None)
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
@click.option(
    "--structured-schema",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A JSON schema file: run the workload with it on every request (structured output), "
    "then the same requests unconstrained with each one's constrained output length "
    "(ignore_eos), and print the ratio. Random presets get a BPE tokenizer of their "
    "vocabulary size.",
)
@click.option(
    "--structured-output-threads",
    type=int,
    default=None,
    help="Threads filling the token masks (default: llguidance's, 80% of the CPUs).",
)
def bench(**kw) -> None:
    """Benchmark the engine on a standard workload (examples/benchmarks/README.md); one table last.

    Times only the generate phase (after model load and warm-up, GPU synchronized); reports
    output / total tok/s, requests/s, peak GPU memory, prefix-cache hit rate, preemptions and
    the roofline fraction against a matmul and a copy ceiling measured in the same run.
    """
    from batchgen.bench.report import format_table
    from batchgen.bench.session import BenchOptions, run_bench

    engine_keys = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "admission_interval",
        "mixed_chunk_tokens",
        "gpu_memory_utilization",
        "num_kv_blocks",
        "block_size",
        "max_model_len",
        "cpu_kv_cache_gb",
        "structured_output_threads",
    )
    options = {k: kw[k] for k in engine_keys if kw[k] is not None}
    if kw["model_path"] is not None:
        try:
            kw["model_path"] = resolve_model(kw["model_path"], kw["revision"])
        except ModelLoadError as e:
            raise click.BadParameter(str(e), param_hint="--model") from None
    elif kw["revision"] is not None:
        raise click.BadParameter("needs --model (a hub repo id)", param_hint="--revision")
    try:
        engine = EngineConfig(
            model=kw["model_path"] or "<random preset>",
            dtype=kw["dtype"],
            quantization="fp8" if kw["quantization"] == "fp8" else None,  # gptq: BenchOptions
            kv_cache_dtype=kw["kv_cache_dtype"],
            calibrate_kv_scales=kw["calibrate_kv_scales"],
            device=kw["device"],
            enforce_eager=kw["enforce_eager"],
            enable_prefix_caching=not kw["no_prefix_caching"],
            fold_norms=not kw["no_fold_norms"],
            kn_weights=not kw["no_kn_weights"],
            tune_gemms=not kw["no_tune_gemms"],
            seed=kw["seed"],
            tensor_parallel_size=kw["tensor_parallel_size"],
            disable_custom_all_reduce=kw["disable_custom_all_reduce"],
            **options,
        )
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    if kw["peer"] and kw["quantization"]:
        raise click.BadParameter(
            "--peer hf runs transformers on 16-bit weights; run it without --quantization"
        )
    gptq = kw["quantization"] == "gptq"
    if gptq and kw["model_path"] is not None:
        raise click.BadParameter(
            "a checkpoint's 4-bit format is read from its config.json; --quantization gptq "
            "builds a random preset",
            param_hint="--quantization",
        )
    group = kw["int4_group_size"]
    if group != -1 and (group <= 0 or group % 32):
        raise click.BadParameter("-1 or a positive multiple of 32", param_hint="--int4-group-size")
    if gptq and kw["int4_act_order"] and kw["tensor_parallel_size"] > 1:
        raise click.BadParameter(
            "act order cannot be split across tensor-parallel ranks (a checkpoint's is refused "
            "too); run it with --tensor-parallel-size 1",
            param_hint="--int4-act-order",
        )
    if gptq:
        from batchgen.bench.random_model import preset_config
        from batchgen.models.config import ModelConfig

        preset = kw["preset"]
        if ModelConfig.from_dict(preset_config(preset), source=preset).moe is not None:
            raise click.BadParameter(
                f"{preset} is a mixture-of-experts model: 4-bit experts are not supported",
                param_hint="--quantization",
            )
    for name in ("repeat", "peer_repeat", "num_prompts", "max_output_tokens"):
        if kw[name] is not None and kw[name] < 1:
            raise click.BadParameter(f"--{name.replace('_', '-')} must be >= 1")
    opts = BenchOptions(
        workload=kw["workload"],
        preset=kw["preset"],
        model_path=kw["model_path"],
        engine=engine,
        peer=kw["peer"],
        repeat=kw["repeat"],
        peer_repeat=kw["peer_repeat"],
        num_prompts=kw["num_prompts"],
        max_output_tokens=kw["max_output_tokens"],
        warmup=kw["warmup"],
        quantization=kw["quantization"],
        int4_group_size=group,
        int4_act_order=kw["int4_act_order"],
        structured_schema=kw["structured_schema"],
    )
    if kw["data_parallel_size"] > 1:
        _data_parallel(opts, kw)
        return
    try:
        report = run_bench(opts, log=lambda m: click.echo(m, err=True))
    except ModelLoadError as e:  # a checkpoint, or a preset with an option it cannot take
        raise click.UsageError(str(e)) from None
    _emit(report, kw["json_out"], format_table)


def _data_parallel(opts, kw) -> None:
    """--data-parallel-size N > 1: the bench in N processes (bench/data_parallel.py)."""
    from batchgen.bench.data_parallel import DataParallelBenchError, format_table, run_data_parallel

    size = kw["data_parallel_size"]
    for name, why in (("peer", "--peer"), ("structured_schema", "--structured-schema")):
        if kw[name]:
            raise click.BadParameter(f"{why} runs in one process; leave out --data-parallel-size")
    if kw["workload"] == "pipeline":
        raise click.BadParameter(
            "the pipeline workload runs in one process", param_hint="--workload"
        )
    if kw["data_parallel_load"] == "split" and kw["num_prompts"] is not None:
        if kw["num_prompts"] < size:
            raise click.BadParameter(f"split over {size} GPUs needs at least {size} prompts")
    try:
        report = run_data_parallel(
            opts, size, kw["data_parallel_load"], log=lambda m: click.echo(m, err=True)
        )
    except DataParallelBenchError as e:
        raise click.UsageError(str(e)) from None
    _emit(report, kw["json_out"], format_table)


def _emit(report: dict, json_out: str | None, format_table) -> None:
    """The report as JSON (when asked) and as the table on stdout."""
    from batchgen.bench.report import write_json

    if json_out:
        write_json(json_out, report)
        click.echo(f"wrote {json_out}", err=True)
    click.echo(format_table(report))
    sys.stdout.flush()
