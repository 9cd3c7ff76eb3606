"""The `batchgen` command line: run, run-batch, validate, plan, status, make-model (and bench;
perplexity from batchgen/perplexity_cli.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click

from batchgen.job import JobError, load_job
from batchgen.perplexity_cli import perplexity
from batchgen.pipeline.exit_codes import (
    EX_TEMPFAIL,
    EXIT_ABORTED,
    EXIT_BAD_JOB,
    EXIT_OK,
    EXIT_ROW_ERRORS,
    describe_failure,
)
from batchgen.pipeline.signals import GracefulStop, StopFlag


def _fail(message: str, code: int = EXIT_BAD_JOB) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextmanager
def _exit_codes() -> Iterator[None]:
    """Every way a command can end becomes its exit code (pipeline/exit_codes.py) and one
    clear line on stderr: a bad job 2, OS errors by errno (2 or 74), anything unforeseen 70
    with its traceback in a crash report, a second Ctrl-C 130. Never a bare traceback."""
    try:
        yield
    except JobError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted twice: stopped at once; committed shards are kept", EXIT_ABORTED)
    except Exception as e:  # the last resort: the exception is what the message names
        code, message = describe_failure(e)
        _fail(message, code)


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


def _slurm_job() -> str:
    """`slurm JOB` (or `slurm ARRAYJOB_TASK`) when run by Slurm: shown with this run's locks."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"slurm {env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
    return f"slurm {env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else ""


def _version() -> str:
    """The installed distribution's version (a plain checkout on PYTHONPATH: the package's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchgen")
    except PackageNotFoundError:
        from batchgen import __version__

        return __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=_version(), prog_name="batchgen", message="%(prog)s %(version)s")
def main() -> None:
    """batchgen: offline batch LLM generation; jobs in, sharded resumable Parquet out."""


_set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a job key, e.g. --set sampling.temperature=0.7 (value parsed as YAML).",
)


_overwrite_option = click.option(
    "--overwrite", is_flag=True, help="Discard outputs of a different job in the output path."
)
_strict_option = click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 if any row of this task's shards ended as an error record.",
)
_shard_option = click.option(
    "--shard",
    "shard",
    metavar="I/N",
    default=None,
    help="Process only shards k with k % N == I (default: from SLURM_ARRAY_TASK_ID/"
    "SLURM_ARRAY_TASK_COUNT, else all).",
)
_progress_option = click.option(
    "--progress/--no-progress", default=None, help="Progress bar (default: on a tty)."
)
_grace_option = click.option(
    "--grace",
    "grace_s",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="After SIGTERM/SIGUSR1/Ctrl-C: how long requests in the engine may still finish "
    "before every finished row is committed and the run exits 75.",
)
_checkpoint_option = click.option(
    "--checkpoint",
    "checkpoint_s",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="Commit the finished rows of unfinished shards this often (0: only when stopped), "
    "so a crash or SIGKILL loses at most this much work.",
)
_lease_option = click.option(
    "--lease",
    "lease_s",
    type=click.FloatRange(min=1),
    default=120.0,
    show_default=True,
    metavar="SECONDS",
    help="Lock lease: a shard whose holder (on another host) has not renewed its lock for "
    "this long is taken over.",
)


def _stop_options(command):
    """--grace, --checkpoint and --lease: how a run stops, saves and shares its shards."""
    return _grace_option(_checkpoint_option(_lease_option(command)))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@_overwrite_option
@_strict_option
@_shard_option
@_progress_option
@_stop_options
def run(
    job_file, overrides, overwrite, strict, shard, progress, grace_s, checkpoint_s, lease_s
) -> None:
    """Run JOB_FILE: generate for every input row and commit sharded output.

    Exit codes: 0 done (row errors are counted, not fatal), 1 row errors in this task's shards
    with --strict, 2 bad job, model, input, usage or a permission error on a path, 70 internal
    error (traceback in a crash report), 74 I/O error such as a full disk, 75 interrupted by
    SIGTERM/SIGUSR1/SIGINT (run again to resume: the finished rows are kept), 130 a second
    SIGINT.
    """
    options = dict(grace_s=grace_s, checkpoint_s=checkpoint_s or None, lease_s=lease_s)
    _run_job(lambda: load_job(job_file, overrides), shard, overwrite, strict, progress, **options)


def _run_job(make_job, shard, overwrite, strict, progress, finish=None, **options) -> None:
    """Build the job with `make_job()`, run this task's shards, report and exit; `finish(job,
    result)` runs once the whole job is complete (before the report). `options`: the Runner's
    grace_s, checkpoint_s and lease_s."""
    # Stop signals are caught from here, before torch is imported (about a second), to the
    # command's end: a Slurm preemption while the run starts up exits 75 (requeue), not -15,
    # and one after the run has finished changes nothing.
    stop = StopFlag()
    with GracefulStop(stop), _exit_codes():
        from batchgen.pipeline.data_parallel import run_task
        from batchgen.pipeline.sharding import ShardSelector

        job = make_job()
        selector = ShardSelector.parse(shard or _default_shard() or "0/1")
        show = sys.stderr.isatty() if progress is None else progress
        if stop.is_set():  # stopped while starting up: nothing was written yet
            click.echo(
                f"interrupted by {stop.signal_name} before the run started; run the same "
                f"command again (exit {EX_TEMPFAIL})"
            )
            sys.exit(EX_TEMPFAIL)
        result = run_task(
            job,
            shard=selector,
            overwrite=overwrite,
            progress=show,
            log=lambda m: click.echo(m, err=True),
            stop=stop,
            holder=_slurm_job(),
            **options,
        )
        extra = finish(job, result) if finish is not None and result.complete else []
        _report(result, job, selector, strict, extra)


def _report(result, job, selector, strict: bool, extra: list[str] = ()) -> None:
    """Print a finished or stopped run's summary (then `extra` lines) and exit with its code."""
    for line in result.lines:
        click.echo(line)
    if result.exit_code not in (EXIT_OK, EXIT_ROW_ERRORS):  # 75 stopped, or a worker failure
        sys.exit(result.exit_code)
    if result.complete:
        click.echo(f"done: {job.output.path}/_SUCCESS written")
    for line in extra:
        click.echo(line)
    # The task's own rows: another task's errors are that task's to report (and exit 1 on).
    errors = result.task_totals["errors"]
    if errors:
        click.echo(
            f"{errors} row(s){selector.task_label()} ended as error records "
            "(see columns error, error_code)"
        )
    sys.exit(EXIT_ROW_ERRORS if strict and errors else EXIT_OK)


@main.command("run-batch")
@click.option("-i", "--input-file", required=True, help="OpenAI batch file (or Parquet/JSONL).")
@click.option("-o", "--output-file", required=True, help="The one file to write when done.")
@click.option("--model", required=True, help="Model directory or hub repo id (ORG/NAME).")
@click.option("--revision", default=None, help="Branch, tag or commit of a hub repo id.")
@click.option(
    "--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default=None
)
@click.option("--max-model-len", type=int, default=None, help="Longest prompt + output.")
@click.option(
    "--prompt-template",
    default=None,
    help="Prompt from a Parquet/JSONL row's columns, e.g. 'Summarize: {text}'.",
)
@click.option("--prompt-column", default=None, help="Use this column as the prompt as it is.")
@click.option("--chat", is_flag=True, help="Send the prompt as a user message (chat template).")
@_set_option
@_overwrite_option
@_strict_option
@_shard_option
@_progress_option
@_stop_options
def run_batch(
    input_file,
    output_file,
    model,
    revision,
    dtype,
    max_model_len,
    prompt_template,
    prompt_column,
    chat,
    overrides,
    overwrite,
    strict,
    shard,
    progress,
    grace_s,
    checkpoint_s,
    lease_s,
) -> None:
    """Run an OpenAI batch file (or Parquet/JSONL with --prompt-template) into OUTPUT_FILE.

    Resumable: state lives in OUTPUT_FILE.parts/ (a sharded output directory; run the same
    command again to resume). When every shard is done, OUTPUT_FILE is written in input order
    (OpenAI batch output lines, or Parquet for *.parquet), request errors also into
    OUTPUT_FILE's .errors.jsonl. Exit codes as for `batchgen run`.
    """
    from batchgen.pipeline.run_batch import BatchArgs, assemble, build_job

    args = BatchArgs(
        input_file,
        output_file,
        model,
        revision,
        dtype,
        max_model_len,
        prompt_template,
        prompt_column,
        chat,
        tuple(overrides),
    )

    def finish(job, result) -> list[str]:
        errors, errors_file = assemble(job, output_file, result.num_shards)
        also = f"; {errors} request error(s) also in {errors_file}" if errors_file else ""
        return [f"wrote {output_file}{also}"]

    options = dict(grace_s=grace_s, checkpoint_s=checkpoint_s or None, lease_s=lease_s)
    _run_job(lambda: build_job(args), shard, overwrite, strict, progress, finish, **options)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
def validate(job_file, overrides) -> None:
    """Check JOB_FILE and every input row without a GPU: counts, token lengths, failing rows."""
    from batchgen.pipeline.validate import validate as run_validate

    with _exit_codes():
        report = run_validate(load_job(job_file, overrides))
    click.echo(f"job {job_file}: ok")
    for line in report.lines():
        click.echo(line)


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@_set_option
@click.option(
    "--overwrite", is_flag=True, help="Discard outputs of a different job in output.path."
)
def plan(job_file, overrides, overwrite) -> None:
    """Make JOB_FILE's shard plan now (one pass over the input; no model weights).

    Every task of the job then seeks straight to its shards. Without this, the first task
    to start makes it while the others wait.
    """
    stop = StopFlag()
    with GracefulStop(stop), _exit_codes():
        from batchgen.pipeline.plan_command import make_plan

        lines = make_plan(load_job(job_file, overrides), overwrite, stop, _log)
    for line in lines:
        click.echo(line)
    sys.exit(EX_TEMPFAIL if stop.is_set() else EXIT_OK)


def _log(message: str) -> None:
    click.echo(message, err=True)


@main.command()
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write a PNG of generated tok/s and rows done over time (needs batchgen[plot]).",
)
def status(out_dir, plot_file) -> None:
    """Show OUT_DIR's progress: shards done, partial shards, who works on what, rows, tokens."""
    from batchgen.pipeline.status import status_lines

    with _exit_codes():
        lines = status_lines(out_dir)
        if plot_file is not None:
            from batchgen.pipeline.status_plot import write_plot

            lines.append(write_plot(out_dir, plot_file))
    for line in lines:
        click.echo(line)


@main.command("make-model")
@click.option(
    "--arch",
    type=click.Choice(["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"]),
    required=True,
)
@click.option(
    "--preset",
    default="tiny",
    show_default=True,
    help="tiny (random weights, seconds) or trained-tiny (llama only: trained on CPU on the "
    "Python standard library's source; about an hour on 2 busy cores).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the weights.")
@click.option("--steps", type=int, default=None, help="trained-tiny: training steps (default 250).")
@click.option(
    "--vocab-size",
    type=click.IntRange(min=262),
    default=None,
    help="A byte-level BPE tokenizer of exactly this many tokens (e.g. 151936) instead of the "
    "trained 512-token one.",
)
@click.argument("out_dir", type=click.Path(file_okay=False))
def make_model(arch, preset, seed, steps, vocab_size, out_dir) -> None:
    """Write a small HF model (config, tokenizer, safetensors) to OUT_DIR."""
    if preset == "trained-tiny":
        if arch != "llama":
            _fail(f"--preset trained-tiny is a llama model, not --arch {arch}")
        if steps is not None and steps < 1:
            _fail("--steps must be >= 1")
        if vocab_size is not None:
            _fail("--vocab-size does not apply to --preset trained-tiny (its BPE is trained)")
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
        build(out_dir, arch, preset, seed, vocab_size=vocab_size)
    except ModelLoadError as e:
        _fail(str(e))
    click.echo(f"wrote {arch}/{preset} model to {out_dir}")


# `batchgen bench` lives in batchgen/bench/cli.py; registered only when that module exists.
if importlib.util.find_spec("batchgen.bench.cli") is not None:
    from batchgen.bench.cli import bench

    main.add_command(bench)

main.add_command(perplexity)


if __name__ == "__main__":
    main()
