"""The `batchgen` command line: run, validate, status, make-model, perplexity (and bench when
present)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import click

from batchgen.job import JobError, load_job
from batchgen.pipeline.signals import EX_TEMPFAIL, GracefulStop, StopFlag

EXIT_OK, EXIT_ROW_ERRORS, EXIT_BAD_JOB = 0, 1, 2


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_BAD_JOB)


def _default_shard() -> str | None:
    """`I/N` from a Slurm array task's environment, if running as one: I counts the array's
    tasks from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP (`--array=0-6:2`)."""
    env = os.environ
    task, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
    if task is None or count is None:
        return None
    try:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        step = int(env.get("SLURM_ARRAY_TASK_STEP", "1") or "1")
        offset, n = int(task) - first, int(count)
    except ValueError:
        raise JobError(
            "cannot read the Slurm array task from SLURM_ARRAY_TASK_ID/_COUNT/_MIN/_STEP "
            f"({task!r}, {count!r}); pass --shard I/N"
        ) from None
    if step < 1 or offset % step or not 0 <= offset // step < n:
        raise JobError(
            f"Slurm array task {task} (min {first}, step {step}, count {n}) is not one of "
            "evenly spaced task ids; pass --shard I/N"
        )
    return f"{offset // step}/{n}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """batchgen: offline batch LLM generation; jobs in, sharded resumable Parquet out."""


_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a job key, e.g. --set sampling.temperature=0.7 (value parsed as YAML).",
)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option(
    "--overwrite", is_flag=True, help="Discard outputs of a different job in output.path."
)
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 if any row of this task's shards ended as an error record.",
)
@click.option(
    "--shard",
    "shard",
    metavar="I/N",
    default=None,
    help="Process only shards k with k % N == I (default: from SLURM_ARRAY_TASK_ID/"
    "SLURM_ARRAY_TASK_COUNT, else all).",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a tty).")
def run(job_file, overrides, overwrite, strict, shard, progress) -> None:
    """Run JOB_FILE: generate for every input row and commit sharded output.

    Exit codes: 0 done (row errors are counted, not fatal), 1 row errors in this task's shards
    with --strict, 2 bad job or usage, 75 interrupted by SIGTERM/SIGUSR1/SIGINT (run again to
    resume).
    """
    # Stop signals are caught from here, before torch is imported (about a second), to the
    # command's end: a Slurm preemption while the run starts up exits 75 (requeue), not -15,
    # and one after the run has finished changes nothing.
    stop = StopFlag()
    with GracefulStop(stop):
        from batchgen.pipeline.runner import Runner
        from batchgen.pipeline.sharding import ShardSelector

        try:
            job = load_job(job_file, overrides)
            selector = ShardSelector.parse(shard or _default_shard() or "0/1")
            show = sys.stderr.isatty() if progress is None else progress
            if stop.is_set():  # stopped while starting up: nothing was written yet
                click.echo(
                    f"interrupted by {stop.signal_name} before the run started; run the same "
                    f"command again (exit {EX_TEMPFAIL})"
                )
                sys.exit(EX_TEMPFAIL)
            result = Runner(
                job,
                shard=selector,
                overwrite=overwrite,
                progress=show,
                log=lambda m: click.echo(m, err=True),
                stop=stop,
            ).run()
        except JobError as e:
            _fail(str(e))
        _report(result, job, selector, strict)


def _report(result, job, selector, strict: bool) -> None:
    """Print a finished or stopped run's summary and exit with its code."""
    for line in result.lines:
        click.echo(line)
    if result.exit_code == EX_TEMPFAIL:
        sys.exit(EX_TEMPFAIL)
    if result.complete:
        click.echo(f"done: {job.output.path}/_SUCCESS written")
    # The task's own rows: another task's errors are that task's to report (and exit 1 on).
    errors = result.task_totals["errors"]
    if errors:
        click.echo(
            f"{errors} row(s){selector.task_label()} ended as error records "
            "(see columns error, error_code)"
        )
    sys.exit(EXIT_ROW_ERRORS if strict and errors else EXIT_OK)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def validate(job_file, overrides) -> None:
    """Check JOB_FILE and every input row without a GPU: counts, token lengths, failing rows."""
    from batchgen.pipeline.validate import validate as run_validate

    try:
        report = run_validate(load_job(job_file, overrides))
    except JobError as e:
        _fail(str(e))
    click.echo(f"job {job_file}: ok")
    for line in report.lines():
        click.echo(line)


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
def status(out_dir) -> None:
    """Show OUT_DIR's progress: shards done, rows ok/error, tokens, throughput."""
    from batchgen.io import manifest
    from batchgen.pipeline.stats import job_totals

    job = manifest.read_job(out_dir)
    if job is None:
        _fail(f"{out_dir}: no batchgen output here (no {manifest.JOB_FILE})")
    entries = {
        k: e
        for k, e in manifest.read_entries(out_dir).items()
        if e.get("fingerprint") == job["fingerprint"]
    }
    totals = job_totals(entries)
    total = job.get("num_shards")
    done = os.path.exists(os.path.join(out_dir, manifest.SUCCESS_FILE))
    click.echo(f"{out_dir}: {'complete' if done else 'in progress'}")
    click.echo(f"shards: {totals['shards']}/{total if total is not None else '?'} committed")
    click.echo(f"rows: {totals['ok']} ok, {totals['errors']} error(s)")
    click.echo(
        f"tokens: {totals['num_prompt_tokens']} prompt ({totals['num_cached_tokens']} "
        f"cached), {totals['num_generated_tokens']} generated"
    )
    try:
        with open(os.path.join(out_dir, manifest.STATS_FILE)) as f:
            last = json.load(f)["last_run"]
        click.echo(
            f"last run (task {last['task']}): {last['wall_s']:.1f} s, "
            f"{last['tokens_per_s']:.1f} generated tok/s"
        )
    except (OSError, ValueError, KeyError):
        pass


@main.command("make-model")
@click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3", "mistral"]), required=True)
@click.option(
    "--preset",
    default="tiny",
    show_default=True,
    help="tiny (random weights, seconds) or trained-tiny (llama only: trained on CPU on the "
    "Python standard library's source; about an hour on 2 busy cores).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the weights.")
@click.option("--steps", type=int, default=None, help="trained-tiny: training steps (default 250).")
@click.argument("out_dir", type=click.Path(file_okay=False))
def make_model(arch, preset, seed, steps, out_dir) -> None:
    """Write a small HF model (config, tokenizer, safetensors) to OUT_DIR."""
    if preset == "trained-tiny":
        if arch != "llama":
            _fail(f"--preset trained-tiny is a llama model, not --arch {arch}")
        if steps is not None and steps < 1:
            _fail("--steps must be >= 1")
        from batchgen.models.trained_tiny import build as train

        try:
            record = train(out_dir, steps=steps, seed=seed, log=lambda m: click.echo(m, err=True))
        except FileNotFoundError as e:
            _fail(str(e))
        click.echo(
            f"wrote trained-tiny model to {out_dir} (held-out loss "
            f"{record['heldout_loss_fp32']:.4f}, {record['seconds']:.0f} s)"
        )
        return
    from batchgen.models.errors import ModelLoadError
    from batchgen.models.make_model import make_model as build

    try:
        build(out_dir, arch, preset, seed)
    except ModelLoadError as e:
        _fail(str(e))
    click.echo(f"wrote {arch}/{preset} model to {out_dir}")


@main.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.argument("text_file", type=click.Path(dir_okay=False))
@click.option("--context", default=2048, show_default=True, help="Most tokens in a window.")
@click.option("--stride", default=512, show_default=True, help="Tokens between window starts.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              default="auto", show_default=True)  # fmt: skip
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--quantization", type=click.Choice(["fp8"]), default=None,
              help="fp8: the projections quantized to FP8 at load (online).")  # fmt: skip
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto",
              show_default=True)  # fmt: skip
@click.option("--calibrate-kv-scales", type=int, default=0, show_default=True,
              help="With --kv-cache-dtype fp8: K/V scales from the first N windows.")  # fmt: skip
@click.option("--json", "json_out", default=None, help="Also write the numbers to this file.")
def perplexity(
    model, text_file, context, stride, dtype, device, quantization, kv_cache_dtype,
    calibrate_kv_scales, json_out,
) -> None:  # fmt: skip
    """Sliding-window perplexity of MODEL on TEXT_FILE (UTF-8, read as one text).

    Windows of --context tokens start every --stride tokens; each scores the tokens past the
    previous window's end (Hugging Face's strided recipe: every token after the first is scored
    once, with at least context - stride tokens before it).
    """
    from batchgen.config import ConfigError
    from batchgen.llm import LLM
    from batchgen.models.errors import ModelLoadError
    from batchgen.plan.perplexity import check_window_args

    try:
        check_window_args(context, stride)
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except ValueError as e:
        _fail(f"{text_file}: {e}" if isinstance(e, UnicodeDecodeError) else str(e))
    except OSError as e:
        _fail(f"{text_file}: cannot read ({e.strerror})")
    try:
        llm = LLM(
            model,
            dtype=dtype,
            device=device,
            max_model_len=context,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            calibrate_kv_scales=calibrate_kv_scales,
        )
    except (ModelLoadError, ConfigError) as e:
        _fail(f"{model}: {e}")
    try:
        show = sys.stderr.isatty()
        out = llm.perplexity([text], context=context, stride=stride, use_tqdm=show)[0]
    except ValueError as e:  # a context past the model's max_position_embeddings
        _fail(f"{model}: {e}")
    if out.error is not None:
        _fail(f"{text_file}: {out.error}")
    record = {
        "model": model,
        "text_file": text_file,
        "context": context,
        "stride": stride,
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_scales": llm.engine.kv_scales() if kv_cache_dtype == "fp8" else None,
        "perplexity": out.perplexity,
        "nll": out.nll,
        "num_tokens": out.num_tokens,
        "num_windows": out.num_windows,
    }
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    click.echo(
        f"perplexity {out.perplexity:.4f} over {out.num_tokens} tokens "
        f"({out.num_windows} windows of <= {context} tokens, stride {stride})"
    )


# `batchgen bench` lives in batchgen/bench/cli.py; registered only when that module exists.
if importlib.util.find_spec("batchgen.bench.cli") is not None:
    from batchgen.bench.cli import bench

    main.add_command(bench)


if __name__ == "__main__":
    main()
