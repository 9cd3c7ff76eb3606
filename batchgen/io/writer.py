"""Writer: result rows -> encoded shard batches -> part files published exactly once.

A batch holds one shard's (or one piece's) output rows in unit order, as an Arrow table
(Parquet) or JSON lines (openai-batch), each row tagged with its unit (input row or group)
index, so pieces committed by earlier runs and rows generated now merge into one shard file in
input order. Files are written to a temp file and published with atomic.publish (link(): the
first commit of a name wins, nothing is ever replaced).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import atomic
from batchgen.io.arrow_types import MIXED, column_array
from batchgen.io.openai_batch import output_line
from batchgen.io.rows import ResultRow
from batchgen.io.score_rows import ScoreRow

if TYPE_CHECKING:
    import polars as pl

# polars is imported in the functions that build frames: importing the writer (the runner, the
# CLI) must not need it.

# The output's format version, part of the job fingerprint: a directory written by another
# version (2: passthrough types fixed by the shard plan, partial pieces) is never resumed.
OUTPUT_VERSION = 2
UNIT = "_unit"  # a piece file's column (Parquet) or key (JSONL) holding each row's unit index
META_KEY = b"batchgen"  # Parquet footer metadata: the file's manifest fields, as JSON


def shard_file(k: int, fmt: str) -> str:
    return f"part-{k:05d}.{'jsonl' if fmt == 'openai-batch' else 'parquet'}"


@dataclass(frozen=True)
class ShardLayout:
    """How result rows become columns.

    Args:
        passthrough: input columns copied through, with the type the shard plan fixed.
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

    passthrough: tuple[tuple[str, Any], ...] = ()  # (column, Arrow type, or MIXED/None: text)
    multi: bool = False
    fmt: str = "parquet"
    compression: str = "zstd"
    model: str = ""
    mode: str = "generate"
    token_logprobs: bool = False
    structured: bool = False
    parse_json: bool = False


def _passthrough(rows: list, name: str, t: Any) -> pa.Array:
    return column_array([r.passthrough.get(name) for r in rows], MIXED if t is None else t)


def to_frame(rows: list[ResultRow], layout: ShardLayout) -> pl.DataFrame:
    """Result rows as a DataFrame with the contract columns but the passthrough ones."""
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
    """Score rows as a DataFrame: one row per candidate, passthrough columns aside."""
    import polars as pl

    def col(name: str, dtype: Any) -> pl.Series:
        return pl.Series(name, [getattr(r, name) for r in rows], dtype=dtype)

    cols = [pl.Series("id", [r.id for r in rows], dtype=pl.String)]
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


def to_table(rows: list, layout: ShardLayout) -> pa.Table:
    """Output rows as an Arrow table: id, the passthrough columns, then the result columns."""
    base = to_frame(rows, layout).to_arrow()
    names = ["id", *(n for n, _ in layout.passthrough), *base.column_names[1:]]
    arrays = [base.column(0)]
    arrays += [_passthrough(rows, n, t) for n, t in layout.passthrough]
    arrays += [base.column(i) for i in range(1, base.num_columns)]
    return pa.table(arrays, names=names)


def _order(r: ResultRow | ScoreRow) -> tuple[int, int]:
    return r.index, getattr(r, "candidate_index", None) or 0


@dataclass
class Batch:
    """Encoded output rows in unit order: `table` (Parquet) or `lines` (openai-batch)."""

    units: list[int]  # each row's unit index
    table: pa.Table | None = None
    lines: list[dict] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.units)


def encode(rows: list, layout: ShardLayout) -> Batch:
    """Result rows (ResultRow or ScoreRow) as a batch, sorted by unit (then candidate)."""
    rows = sorted(rows, key=_order)
    units = [r.index for r in rows]
    if layout.fmt == "openai-batch":
        return Batch(units, lines=[output_line(r, layout.model) for r in rows])
    return Batch(units, table=to_table(rows, layout))


def merge(batches: list[Batch]) -> Batch:
    """One batch of several (disjoint units), in unit order; rows of one unit keep theirs."""
    units = [u for b in batches for u in b.units]
    order = sorted(range(len(units)), key=units.__getitem__)  # stable: candidates in order
    if batches and batches[0].lines is not None:
        lines = [line for b in batches for line in b.lines or []]
        return Batch([units[i] for i in order], lines=[lines[i] for i in order])
    tables = [b.table for b in batches if b.table is not None and b.table.num_rows]
    if not tables:
        return batches[0] if batches else Batch([])
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return Batch([units[i] for i in order], table=table.take(pa.array(order, pa.int64())))


def write_temp(final: str, batch: Batch, layout: ShardLayout, meta: dict, units: bool) -> str:
    """Write `batch` to a temp file beside `final`; returns the temp's path. `units` keeps
    each row's unit (a piece, merged later); `meta` goes to a Parquet file's footer."""
    tmp = atomic.temp_path(final)
    try:
        if batch.lines is not None or layout.fmt == "openai-batch":
            with open(tmp, "w", encoding="utf-8") as f:
                for u, line in zip(batch.units, batch.lines or []):
                    rec = {UNIT: u, "record": line} if units else line
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        else:
            table = batch.table
            if units:
                table = table.append_column(UNIT, pa.array(batch.units, pa.int64()))
            table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
            codec = "none" if layout.compression == "none" else layout.compression
            pq.write_table(table, tmp, compression=codec)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise atomic.named(_plain(e), final) from e
        raise
    return tmp


def _plain(e: OSError) -> OSError:
    """An OSError in its errno's own words: pyarrow's wraps them ("Error writing bytes to
    file. Detail: [errno 28] No space left on device") and names no file."""
    if e.filename is None and e.errno:
        return OSError(e.errno, os.strerror(e.errno))  # the errno's subclass, e.g. ENOSPC
    return e


def read_batch(path: str, layout: ShardLayout) -> Batch:
    """A piece file (written with units=True) back as a batch."""
    if layout.fmt == "openai-batch":
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
        return Batch([r[UNIT] for r in recs], lines=[r["record"] for r in recs])
    table = pq.read_table(path)
    units = table.column(UNIT).to_pylist()
    return Batch(units, table=table.drop_columns([UNIT]).replace_schema_metadata(None))


def file_meta(path: str) -> dict | None:
    """The manifest fields a Parquet file carries in its footer, or None."""
    try:
        meta = pq.read_schema(path).metadata or {}
        return json.loads(meta[META_KEY]) if META_KEY in meta else None
    except Exception:
        return None


def size_and_sha256(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def publish_file(final: str, batch: Batch, layout: ShardLayout, meta: dict, units=False):
    """Write and publish `final` unless it exists. Returns (published, size, sha256)."""
    tmp = write_temp(final, batch, layout, meta, units)
    size, sha = size_and_sha256(tmp)
    return atomic.publish(tmp, final), size, sha


def write_shard(
    out_dir: str, k: int, rows: list, layout: ShardLayout, meta: dict | None = None
) -> dict:
    """Write shard k's file (unless it already exists); returns its manifest entry fields
    (file, size, sha256). Raises FileExistsError if another commit published it first."""
    final = os.path.join(out_dir, shard_file(k, layout.fmt))
    published, size, sha = publish_file(final, encode(rows, layout), layout, meta or {})
    if not published:
        raise FileExistsError(final)
    return {"file": os.path.basename(final), "size": size, "sha256": sha}
