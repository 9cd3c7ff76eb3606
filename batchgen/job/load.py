"""Load a job YAML file, apply `--set` overrides and validate it into a JobSpec.

Nothing here imports torch or loads a model: every error a job file can have is raised as a
JobError naming the key path before any GPU work starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import yaml

from batchgen.config import ConfigError, EngineConfig
from batchgen.job.keys import check_type, get, section, unknown_key
from batchgen.job.placeholders import placeholders
from batchgen.job.score import score_spec
from batchgen.job.spec import (
    COMPRESSIONS,
    DEFAULT_MAX_ROW_BYTES,
    INPUT_FORMATS,
    MODES,
    OUTPUT_FORMATS,
    ChatMessage,
    InputSpec,
    JobError,
    JobSpec,
    ModelSpec,
    OutputSpec,
    PromptSpec,
    SamplingSpec,
)
from batchgen.job.yaml_loader import JobYAMLError, load_yaml
from batchgen.sampling_params import SamplingParams, SamplingParamsError
from batchgen.short_repr import short_repr
from batchgen.structured_outputs import StructuredOutputsError, StructuredOutputsParams


def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Read, override and validate a job file.

    Args:
        path: the YAML job file.
        overrides: `key.path=value` strings; value is parsed as a YAML scalar.
    Returns:
        The validated JobSpec. Raises JobError on any problem.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(f"{path}: cannot read job file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise JobError(f"{path}: job file is not UTF-8 text") from None
    raw = parse_yaml(text, str(path))
    for item in overrides:
        apply_override(raw, item)
    try:
        return validate_job(raw, source=str(path))
    except JobError as e:
        # Validation names the key; the message names the file too, as the model-limit checks
        # do (pipeline/job_limits.py): a cron or Slurm log holds many jobs' errors.
        raise JobError(f"{path}: {e}") from None


def parse_yaml(text: str, source: str) -> dict:
    """Load a job document with batchgen.job.yaml_loader's loader (safe_load values, no duplicate or
    non-scalar keys, no alias bombs); every problem is a JobError naming the line."""
    try:
        raw = load_yaml(text)
    except JobYAMLError as e:
        raise JobError(f"{source} (line {e.line}): {e.message}") from None
    except yaml.constructor.ConstructorError as e:
        where = f" (line {e.problem_mark.line + 1})" if e.problem_mark else ""
        if "could not determine a constructor" not in (e.problem or ""):
            raise JobError(f"{source}{where}: invalid YAML: {e.problem}") from None
        raise JobError(
            f"{source}{where}: YAML tags such as {_tag_of(e)} are not allowed; job files hold "
            "plain values only (loaded with yaml.safe_load)"
        ) from None
    except yaml.YAMLError as e:
        raise JobError(f"{source}: invalid YAML: {e}") from None
    except RecursionError:
        raise JobError(f"{source}: YAML nested too deeply to be a job file") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{source}: the job must be a mapping of sections (model, input, ...)")
    return raw


def _tag_of(e: yaml.constructor.ConstructorError) -> str:
    problem = e.problem or ""
    start = problem.find("'")
    tag = problem[start + 1 : problem.find("'", start + 1)] if start >= 0 else "this"
    return repr(tag.replace("tag:yaml.org,2002:", "!!"))


def apply_override(raw: dict, item: str) -> None:
    """Apply one `a.b.c=value` override to the raw job mapping (in place)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise JobError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. sampling.temperature=0.7")
    try:
        parsed = load_yaml(value) if value.strip() else ""
    except JobYAMLError as e:
        raise JobError(f"--set {item!r}: {e.message}") from None
    except (yaml.YAMLError, RecursionError):
        parsed = value
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise JobError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = parsed


def validate_job(raw: dict, source: str = "<job>") -> JobSpec:
    """Turn a raw job mapping into a JobSpec, raising JobError naming the first bad key path."""
    top = ["model", "input", "prompt", "sampling", "output", "mode", "score"]
    for key in raw:
        if key not in top:
            raise unknown_key("", key, top)
    mode = raw.get("mode", "generate")
    if mode not in MODES:
        raise JobError(f"mode: {short_repr(mode)} is not supported (supported: {', '.join(MODES)})")
    model = _model_spec(raw)
    inp = _input_spec(raw)
    prompt = _prompt_spec(raw, inp)
    sampling = _sampling_spec(raw)
    output = _output_spec(raw)
    score = score_spec(raw, mode, inp, prompt, output)
    return JobSpec(model, inp, prompt, sampling, output, mode, source, score)


def _model_spec(raw: dict) -> ModelSpec:
    engine_fields = {f.name: f.type for f in fields(EngineConfig)}
    known = ["path", "dtype", "revision", "data_parallel_size"]
    known += [n for n in EngineConfig.option_names() if n != "model"]
    known = list(dict.fromkeys(known))
    sec = section(raw, "model", known)
    path = get(sec, "model", "path", "str")
    dtype = get(sec, "model", "dtype", "str", "auto")
    revision = get(sec, "model", "revision", "str", None)
    if revision is not None and not revision.strip():
        raise JobError(
            "model.revision: must not be empty (a branch, tag or commit of the hub repo)"
        )
    data_parallel = _data_parallel_size(sec.get("data_parallel_size", "auto"))
    options = {}
    for key, value in sec.items():
        if key in ("path", "dtype", "revision", "data_parallel_size"):
            continue
        options[key] = check_type(f"model.{key}", value, str(engine_fields[key]))
    path = check_path("model.path", path)
    options_t = tuple(sorted(options.items()))
    spec = ModelSpec(path, dtype, options_t, revision, data_parallel_size=data_parallel)
    try:
        spec.engine_config()
    except ConfigError as e:
        raise JobError(f"model.{e}") from None
    return spec


def _data_parallel_size(value) -> int | None:
    """model.data_parallel_size: `auto` (None) or an integer >= 1."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobError(
            f"model.data_parallel_size: {short_repr(value)} is neither auto nor an integer >= 1"
        )
    return value


def _input_spec(raw: dict) -> InputSpec:
    sec = section(raw, "input", ["path", "format", "id_column", "columns", "max_row_bytes"])
    path = check_path("input.path", get(sec, "input", "path", "str"))
    fmt = get(sec, "input", "format", "str", "auto", INPUT_FORMATS)
    id_column = get(sec, "input", "id_column", "str", "id")
    max_row_bytes = get(sec, "input", "max_row_bytes", "int", DEFAULT_MAX_ROW_BYTES)
    if max_row_bytes < 1:
        raise JobError(f"input.max_row_bytes: {max_row_bytes} must be >= 1")
    columns = sec.get("columns") or []
    if isinstance(columns, str) or not isinstance(columns, list):
        raise JobError(f"input.columns: expected a list of column names, got {short_repr(columns)}")
    for i, c in enumerate(columns):
        if not isinstance(c, str) or not c:
            raise JobError(f"input.columns[{i}]: expected a column name, got {short_repr(c)}")
    return InputSpec(path, fmt, id_column, tuple(columns), max_row_bytes)


def _prompt_spec(raw: dict, inp: InputSpec) -> PromptSpec:
    # OpenAI batch lines carry their own prompts; with format auto, require_prompt() decides
    # once the input files are known.
    required = inp.format not in ("openai-batch", "auto")
    sec = section(raw, "prompt", ["template", "chat", "chat_template"], required=required)
    template = get(sec, "prompt", "template", "str", None)
    chat_template = get(sec, "prompt", "chat_template", "str", None)
    chat_raw = sec.get("chat")
    if (required or sec) and (template is None) == (chat_raw is None):
        raise JobError("prompt: give exactly one of prompt.template or prompt.chat")
    chat = None
    if chat_raw is not None:
        if not isinstance(chat_raw, list) or not chat_raw:
            raise JobError("prompt.chat: expected a non-empty list of {role, content} messages")
        msgs = []
        for i, m in enumerate(chat_raw):
            where = f"prompt.chat[{i}]"
            if not isinstance(m, dict):
                raise JobError(f"{where}: expected a mapping with role and content")
            for key in m:
                if key not in ("role", "content"):
                    raise unknown_key(where, key, ["role", "content"])
            role = get(m, where, "role", "str")
            if role not in ("system", "user", "assistant"):
                raise JobError(
                    f"{where}.role: {short_repr(role)} is not one of system, user, assistant"
                )
            msgs.append(ChatMessage(role, get(m, where, "content", "str")))
        chat = tuple(msgs)
    spec = PromptSpec(template, chat, chat_template)
    placeholders(spec)  # JobError naming the key if a placeholder is malformed
    return spec


def _sampling_spec(raw: dict) -> SamplingSpec:
    types = {f.name: str(f.type) for f in fields(SamplingParams)}
    sec = section(raw, "sampling", list(types) + ["overrides_column"], required=False)
    params = {}
    for key, value in sec.items():
        if key == "overrides_column":
            continue
        if key == "structured_outputs":
            params[key] = structured_outputs(value)
            continue
        params[key] = check_type(f"sampling.{key}", value, types[key])
    try:
        SamplingParams(**params)
    except SamplingParamsError as e:
        raise JobError(str(e).replace("SamplingParams.", "sampling.")) from None
    for key in ("stop", "stop_token_ids"):
        if key in params and params[key] is not None:
            params[key] = tuple([params[key]] if isinstance(params[key], str) else params[key])
    overrides_column = get(sec, "sampling", "overrides_column", "str", None)
    return SamplingSpec(tuple(sorted(params.items())), overrides_column)


def structured_outputs(value) -> dict | None:
    """sampling.structured_outputs as plain data ({kind: value}), checked for shape. A `json`
    value that is a string and not JSON text (it does not start with "{") names a schema file,
    relative to the working directory like every job path; its content replaces it, so the
    job's fingerprint covers the schema itself. Whether the grammar engine accepts the
    constraint is checked once the job is loaded (pipeline/job_limits.py)."""
    if value is None:
        return None
    key = "sampling.structured_outputs"
    if isinstance(value, dict) and isinstance(value.get("json"), str):
        text = value["json"]
        if not text.lstrip().startswith("{"):
            value = {**value, "json": _schema_file(f"{key}.json", text)}
    try:
        return StructuredOutputsParams.from_value(value).to_dict()
    except (StructuredOutputsError, TypeError) as e:
        raise JobError(f"{key}{str(e).removeprefix('structured_outputs')}") from None


def _schema_file(key: str, path: str) -> object:
    """The JSON content of a schema file named in the job."""
    check_path(key, path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(f"{key}: cannot read schema file {path!r} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise JobError(f"{key}: schema file {path!r} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise JobError(f"{key}: schema file {path!r} is not JSON ({e})") from None


def _output_spec(raw: dict) -> OutputSpec:
    sec = section(raw, "output", ["path", "shard_rows", "compression", "format", "parse_json"])
    path = check_path("output.path", get(sec, "output", "path", "str"), output=True)
    shard_rows = get(sec, "output", "shard_rows", "int", 10000)
    if shard_rows < 1:
        raise JobError(f"output.shard_rows: {shard_rows} must be >= 1")
    compression = get(sec, "output", "compression", "str", "zstd", COMPRESSIONS)
    fmt = get(sec, "output", "format", "str", "parquet", OUTPUT_FORMATS)
    parse_json = get(sec, "output", "parse_json", "bool", False)
    if parse_json and fmt == "openai-batch":
        raise JobError("output.parse_json: only Parquet output has a json column")
    return OutputSpec(path, shard_rows, compression, fmt, parse_json)


def require_prompt(job: JobSpec, formats: list[str]) -> None:
    """Refuse a job without prompt.template/chat whose input has rows that are not OpenAI lines."""
    if job.prompt.template is None and job.prompt.chat is None:
        plain = [f for f in formats if f != "openai-batch"]
        if plain:
            raise JobError(
                f"prompt: missing prompt.template or prompt.chat (needed for {plain[0]} input)"
            )


def check_path(key: str, path: str, output: bool = False) -> str:
    """Refuse an empty path, a relative path whose `..` components escape the working dir, and
    an output path with any `..` component at all.

    Relative paths are relative to the current working directory (not the job file's); an
    absolute path is taken as given. Output paths are written (and cleared by --overwrite), and
    after a symlink `link/..` is the link target's parent, not `.`: no reading of the text can
    tell where such a path lands, so `..` is refused there before any normalisation.
    """
    if not path.strip():
        raise JobError(f"{key}: must not be empty")
    parts = Path(path).parts  # splits on separators only: `..` stays as written
    if not os.path.isabs(path):
        depth = 0
        for part in parts:
            depth += -1 if part == ".." else (0 if part == "." else 1)
            if depth < 0:
                raise JobError(
                    f"{key}: {short_repr(path)} escapes the working directory through '..'; "
                    "relative paths must stay inside it (use an absolute path to go elsewhere)"
                )
    if output and ".." in parts:
        raise JobError(
            f"{key}: {short_repr(path)} has a '..' component; write the output path without "
            "'..' (through a symlink it can land anywhere)"
        )
    return path
