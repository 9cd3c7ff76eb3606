"""The job spec: frozen dataclasses a validated job file becomes (no parsing, no I/O)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from batchgen.config import EngineConfig

MODES = ("generate", "score")
INPUT_FORMATS = ("auto", "parquet", "jsonl", "openai-batch")
OUTPUT_FORMATS = ("parquet", "openai-batch")
COMPRESSIONS = ("zstd", "snappy", "gzip", "lz4", "none")


class JobError(ValueError):
    """The job file (or a --set override) cannot be used; the message names the key path."""


@dataclass(frozen=True)
class ModelSpec:
    path: str  # a model directory, or a hub repo id until the pipeline resolves it
    dtype: str = "auto"
    options: tuple[tuple[str, Any], ...] = ()  # engine options beyond path/dtype, sorted
    revision: str | None = None  # of a hub repo id
    hub_id: str | None = None  # the repo id `path` was resolved from (path is then its snapshot)
    # Engines `batchgen run` starts, one per group of tensor_parallel_size GPUs; None: auto
    # (every visible GPU's group, 1 on CPU). Not an engine option: a run's, outside the
    # fingerprint.
    data_parallel_size: int | None = None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.path, dtype=self.dtype, **dict(self.options))

    @property
    def name(self) -> str:
        """The model's name in outputs: the hub id, else the directory's own name."""
        return self.hub_id or os.path.basename(os.path.normpath(self.path))


# A row larger than this becomes a row_too_large error record before it is parsed or
# tokenized: tokenizing costs about 170 bytes of memory per character, so a 4 MiB row peaks
# near 0.7 GB, and a 100 MB row would take the run down.
DEFAULT_MAX_ROW_BYTES = 4 << 20


@dataclass(frozen=True)
class InputSpec:
    path: str
    format: str = "auto"
    id_column: str = "id"
    columns: tuple[str, ...] = ()  # passed through to the output unchanged
    # JSONL: the line's length; Parquet: the bytes of the text columns the job reads.
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str  # may hold {column} placeholders


@dataclass(frozen=True)
class PromptSpec:
    template: str | None = None
    chat: tuple[ChatMessage, ...] | None = None
    chat_template: str | None = None  # overrides the model's own chat template


@dataclass(frozen=True)
class SamplingSpec:
    params: tuple[tuple[str, Any], ...] = ()  # SamplingParams fields given in the job, sorted
    overrides_column: str | None = None

    def base_params(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def may_constrain(self) -> bool:
        """Rows may carry structured_outputs: the job sets it, or rows may (overrides)."""
        return self.overrides_column is not None or "structured_outputs" in dict(self.params)


@dataclass(frozen=True)
class OutputSpec:
    path: str
    shard_rows: int = 10000
    compression: str = "zstd"
    format: str = "parquet"
    parse_json: bool = False  # write a `json` column: the text parsed, as normalised JSON text


@dataclass(frozen=True)
class ScoreSpec:
    """Score mode settings.

    Two input layouts:
      - list: `candidates_column` holds a list of candidate strings per row.
      - group: one row per candidate; consecutive rows with the same `group_column` value form
        one group (the output `id`), the prompt comes from the group's first row and the
        candidate from each row's `candidate_column`.
    """

    candidates_column: str | None = None
    group_column: str | None = None
    candidate_column: str | None = None
    separator: str = ""  # joined as prompt + separator + candidate
    return_token_logprobs: bool = False

    @property
    def grouped(self) -> bool:
        return self.group_column is not None


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec
    input: InputSpec
    prompt: PromptSpec
    sampling: SamplingSpec
    output: OutputSpec
    mode: str = "generate"
    source: str = "<job>"  # the job file, for messages
    score: ScoreSpec | None = None  # mode: score only (batchgen/job/score.py)
