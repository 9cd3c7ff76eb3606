"""Writer: one shard's result rows -> part-NNNNN.parquet (or .jsonl), committed atomically."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.io import atomic
from batchgen.io.openai_batch import output_line
from batchgen.io.rows import ResultRow
from batchgen.io.score_rows import ScoreRow

if TYPE_CHECKING:
    import polars as pl

# polars is imported in the functions that build frames: importing the writer (the runner, the
# CLI) must not need it.


def shard_file(k: int, fmt: str) -> str:
    return f"part-{k:05d}.{'jsonl' if fmt == 'openai-batch' else 'parquet'}"


@dataclass(frozen=True)
class ShardLayout:
    """How result rows become columns.

    Args:
        passthrough: input columns copied through, with their input dtype when known.
        multi: n > 1 layout (text, finish_reason and num_output_tokens are lists).
        fmt: "parquet" or "openai-batch".
        compression: Parquet compression codec ("none" for uncompressed).
        model: the model name written in OpenAI-style records.
        mode: "generate" (ResultRow) or "score" (ScoreRow: one row per candidate).
        token_logprobs: score mode writes the per-token log-probs column.
        structured: rows may be constrained (structured_outputs): the `incomplete` column.
        parse_json: the `json` column (each text parsed as JSON, written back as normalised
            JSON text; null where the text is no complete JSON value).
    """

    passthrough: tuple[tuple[str, Any], ...] = ()  # (column, polars dtype or None)
    multi: bool = False
    fmt: str = "parquet"
    compression: str = "zstd"
    model: str = ""
    mode: str = "generate"
    token_logprobs: bool = False
    structured: bool = False
    parse_json: bool = False


def _as_text(value: Any) -> str | None:
    """A passthrough value as text: strings unchanged, anything else as its JSON text."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _column(values: list[Any], dtype: Any) -> pl.Series:
    """A passthrough column: the inputs' own dtype when every input file declares the same one
    (Parquet), else text. The type never depends on a shard's values, so every shard of a job
    has one schema, and no value is ever cast to null."""
    import polars as pl

    if dtype is not None:
        try:
            return pl.Series(values=values, dtype=dtype, strict=True)
        except Exception:
            pass  # a value its file's dtype cannot hold: keep it, as text
    return pl.Series(values=[_as_text(v) for v in values], dtype=pl.String)


def to_frame(rows: list[ResultRow], layout: ShardLayout) -> pl.DataFrame:
    """Result rows as a DataFrame with the contract columns (see README: Output)."""
    import polars as pl

    if layout.mode == "score":
        return score_frame(rows, layout)  # type: ignore[arg-type]
    str_t = pl.List(pl.String) if layout.multi else pl.String
    int_t = pl.List(pl.Int64) if layout.multi else pl.Int64

    def shaped(value: Any) -> Any:
        # n > 1 layout: an error row's scalar "error" / 0 becomes a one-element list.
        if layout.multi and value is not None and not isinstance(value, list):
            return [value]
        return value

    cols: dict[str, pl.Series] = {"id": pl.Series("id", [r.id for r in rows], dtype=pl.String)}
    for name, dtype in layout.passthrough:
        cols[name] = _column([r.passthrough.get(name) for r in rows], dtype).alias(name)
    cols["text"] = pl.Series("text", [shaped(r.text) for r in rows], dtype=str_t)
    cols["finish_reason"] = pl.Series(
        "finish_reason", [shaped(r.finish_reason) for r in rows], dtype=str_t
    )
    cols["error"] = pl.Series("error", [r.error for r in rows], dtype=pl.String)
    cols["error_code"] = pl.Series("error_code", [r.error_code for r in rows], dtype=pl.String)
    cols["num_prompt_tokens"] = pl.Series([r.num_prompt_tokens for r in rows], dtype=pl.Int64)
    cols["num_output_tokens"] = pl.Series([shaped(r.num_output_tokens) for r in rows], dtype=int_t)
    cols["num_cached_tokens"] = pl.Series([r.num_cached_tokens for r in rows], dtype=pl.Int64)
    if layout.structured:
        bool_t = pl.List(pl.Boolean) if layout.multi else pl.Boolean
        cols["incomplete"] = pl.Series([shaped(r.incomplete) for r in rows], dtype=bool_t)
    if layout.parse_json:
        parsed = [_parsed(r.text) for r in rows]
        cols["json"] = pl.Series(parsed, dtype=str_t)
    return pl.DataFrame([s.alias(n) for n, s in cols.items()])


def _parsed(text: str | list[str] | None) -> str | list[str | None] | None:
    """A generated text parsed as JSON and written back compactly (one schema whatever the
    value's shape: a JSON text column, which DuckDB, polars or pandas decode), or None when it
    is no complete JSON value (cut by max_tokens, or not JSON at all)."""
    if isinstance(text, list):
        return [_parsed(t) for t in text]  # type: ignore[misc]
    if text is None:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def score_frame(rows: list[ScoreRow], layout: ShardLayout) -> pl.DataFrame:
    """Score rows as a DataFrame: one row per candidate (see README: Score mode)."""
    import polars as pl

    def col(name: str, dtype: Any) -> pl.Series:
        return pl.Series(name, [getattr(r, name) for r in rows], dtype=dtype)

    cols = [pl.Series("id", [r.id for r in rows], dtype=pl.String)]
    for name, dtype in layout.passthrough:
        cols.append(_column([r.passthrough.get(name) for r in rows], dtype).alias(name))
    cols += [
        col("candidate_index", pl.Int64),
        col("candidate", pl.String),
        col("score", pl.Float64),
        col("num_tokens", pl.Int64),
        col("mean", pl.Float64),
        col("rank", pl.Int64),
        col("greedy_match", pl.Boolean),
        col("error", pl.String),
        col("error_code", pl.String),
        col("num_prompt_tokens", pl.Int64),
        col("num_cached_tokens", pl.Int64),
    ]
    if layout.token_logprobs:
        cols.append(col("token_logprobs", pl.List(pl.Float64)))
    return pl.DataFrame(cols)


def _order(r: ResultRow | ScoreRow) -> tuple[int, int]:
    return r.index, getattr(r, "candidate_index", None) or 0


def write_shard(out_dir: str, k: int, rows: list[ResultRow], layout: ShardLayout) -> dict:
    """Write shard k atomically; returns its manifest entry fields (file, rows, size, sha256)."""
    rows = sorted(rows, key=_order)
    final = os.path.join(out_dir, shard_file(k, layout.fmt))
    tmp = atomic.temp_path(final)
    try:
        if layout.fmt == "openai-batch":
            with open(tmp, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(output_line(r, layout.model), ensure_ascii=False) + "\n")
        else:
            codec = "uncompressed" if layout.compression == "none" else layout.compression
            to_frame(rows, layout).write_parquet(tmp, compression=codec)
        size, sha = _size_and_sha256(tmp)
        atomic.commit(tmp, final)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        error = _os_error(e)
        if error is not None:
            raise atomic.named(error, final) from e
        raise
    return {"file": os.path.basename(final), "size": size, "sha256": sha}


_POLARS_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, or the one polars reports in its message
    ("... No space left on device (os error 28)"); None for any other failure."""
    import polars as pl

    if isinstance(e, OSError):
        return e
    found = _POLARS_OS_ERROR.search(str(e)) if isinstance(e, pl.exceptions.PolarsError) else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _size_and_sha256(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
