"""`batchgen run-batch`: the job a command line describes, built in code and run by the usual
Runner; once every shard is committed, its parts become the one output file asked for.

The resumable state is a normal sharded output directory beside the output file
(`OUT.parts/`): a rerun of the same command resumes there, a changed one is refused unless
--overwrite, and Slurm array tasks share it as they share any job's output directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from batchgen.io.assemble import concat_jsonl, concat_parquet, errors_path, part_files
from batchgen.io.readers import file_format, resolve_inputs
from batchgen.job import JobError, JobSpec
from batchgen.job.load import apply_override, check_path, validate_job


@dataclass(frozen=True)
class BatchArgs:
    """The command line of `batchgen run-batch` (vLLM's run-batch flags where they apply)."""

    input_file: str
    output_file: str
    model: str
    revision: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    prompt_template: str | None = None
    prompt_column: str | None = None
    chat: bool = False  # the prompt is one user message, rendered with the chat template
    overrides: tuple[str, ...] = ()


def parts_dir(output_file: str) -> str:
    return output_file + ".parts"


def output_format(output_file: str) -> str:
    """Parquet for `*.parquet`, else OpenAI batch output lines."""
    return "parquet" if output_file.endswith(".parquet") else "openai-batch"


def _cli_path(key: str, path: str, output: bool = False) -> str:
    """A command-line file as given, or absolute where a job file's rules refuse it (a relative
    path through '..'): a file named on the command line may lie anywhere."""
    try:
        return check_path(key, path, output)
    except JobError:
        return os.path.abspath(path)


def build_job(args: BatchArgs) -> JobSpec:
    """The JobSpec of a run-batch command line (`--set` applies to it like to a job file);
    raises JobError naming the flag or key that is wrong."""
    if args.prompt_template is not None and args.prompt_column is not None:
        raise JobError("give one of --prompt-template or --prompt-column, not both")
    if os.path.isdir(args.output_file):
        raise JobError(f"-o/--output-file: {args.output_file!r} is a directory; name a file")
    out = _cli_path("output.path", args.output_file, output=True)
    raw: dict = {
        "model": {"path": args.model},
        "input": {"path": _cli_path("input.path", args.input_file)},
        "output": {"path": parts_dir(out), "format": output_format(out)},
    }
    for key, value in (
        ("revision", args.revision),
        ("dtype", args.dtype),
        ("max_model_len", args.max_model_len),
    ):
        if value is not None:
            raw["model"][key] = value
    template = args.prompt_template
    if args.prompt_column is not None:
        template = "{" + args.prompt_column + "}"
    if template is not None:
        raw["prompt"] = (
            {"chat": [{"role": "user", "content": template}]}
            if args.chat
            else {"template": template}
        )
    elif args.chat:
        raise JobError("--chat needs --prompt-template or --prompt-column")
    for item in args.overrides:
        apply_override(raw, item)
    job = validate_job(raw, source="run-batch")
    if job.prompt.template is None and job.prompt.chat is None:
        for f in resolve_inputs(job.input.path):
            if file_format(f, job.input.format) != "openai-batch":
                raise JobError(
                    f"-i/--input-file: {f} holds no OpenAI batch requests (lines with custom_id, "
                    "url and body); give --prompt-template or --prompt-column to make prompts "
                    "from its columns"
                )
    return job


def assemble(job: JobSpec, output_file: str, num_shards: int) -> tuple[int, str | None]:
    """Write the finished job's parts into `output_file` atomically, in input order.

    Returns:
        (rows with an error, the errors file written or None). OpenAI batch output also puts
        the error lines into `errors_path(output_file)`, as OpenAI's batch API does.
    """
    fmt = job.output.format
    parts = part_files(job.output.path, "jsonl" if fmt == "openai-batch" else "parquet")
    if len(parts) != num_shards:
        raise JobError(
            f"{job.output.path}: {len(parts)} part files for a job of {num_shards} shards; run "
            "the same command again, or pass --overwrite to start over"
        )
    if fmt == "parquet":
        concat_parquet(parts, output_file)
        return 0, None
    errors_file = errors_path(output_file)
    count = concat_jsonl(parts, output_file, errors_file)
    return count, errors_file if count else None
