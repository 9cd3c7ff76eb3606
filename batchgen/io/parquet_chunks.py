"""Parquet input in row chunks; rows that cannot be decoded are reported by range, not raised."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

# polars is imported in the functions that read: importing the readers (the runner, the CLI)
# must not need it.


def _decode_errors() -> tuple[type[BaseException], ...]:
    """What decoding a damaged file raises: ComputeError for a corrupt page or invalid UTF-8 in
    a string column (polars validates it, so no lone surrogate reaches Python), a Rust panic for
    stranger damage (PanicException is no Exception subclass), OSError for a failing disk."""
    import polars as pl

    return (pl.exceptions.PolarsError, pl.exceptions.PanicException, OSError)


@dataclass
class Piece:
    """Consecutive rows of one file: decoded records, or why they could not be decoded.

    A chunk is normally one piece; a chunk that fails to decode is split at row-group
    boundaries (the unit a corrupt page spoils), so only the damaged row groups are lost.
    """

    start: int  # the file's row number (0-based) of the first row
    num_rows: int
    records: list[dict[str, Any]] | None  # None: the rows could not be decoded
    ids: list[Any] | None = None  # undecodable rows: the id column, when it alone decodes
    error: str | None = None
    damaged: tuple[int, int] | None = None  # undecodable rows: their row group's [first, last]
    # Rows over max_row_bytes (position in the piece -> bytes): their records keep only the
    # id, the text never reaches Python.
    too_large: dict[int, int] = field(default_factory=dict)


def read_chunks(
    path: str,
    id_column: str,
    columns: list[str],
    chunk_rows: int,
    max_row_bytes: int | None = None,
    first_row: int = 0,
) -> Iterator[list[Piece]]:
    """Yields the file's rows from `first_row` on as lists of pieces of `chunk_rows` rows in
    all (the last fewer).

    The row count and row groups come from the footer, which must be readable (the job's
    column check reads it first); data pages are decoded chunk by chunk, and only the row
    groups a chunk's rows lie in are read. A row whose columns (besides the id) hold more
    than `max_row_bytes` bytes of text is measured in Arrow and listed in its piece's
    `too_large`, its values left out of its record.
    """
    import polars as pl

    lf = pl.scan_parquet(path)
    names = set(lf.collect_schema().names())
    cols = [id_column] + [c for c in columns if c in names]
    total = lf.select(pl.len()).collect().item()
    for start in range(first_row, total, chunk_rows):
        num_rows = min(chunk_rows, total - start)
        try:
            pieces = [_piece(lf, cols, start, num_rows, max_row_bytes)]
        except _decode_errors():
            pieces = _salvage(path, lf, cols, start, num_rows, max_row_bytes)
        yield pieces


def _piece(lf: pl.LazyFrame, cols: list[str], start: int, n: int, max_row_bytes) -> Piece:
    records, too_large = _decode(lf, cols, start, n, max_row_bytes)
    return Piece(start, n, records, too_large=too_large)


def _decode(
    lf: pl.LazyFrame, cols: list[str], start: int, num_rows: int, max_row_bytes: int | None
) -> tuple[list[dict], dict[int, int]]:
    import polars as pl

    frame = lf.select(cols).slice(start, num_rows).collect()
    too_large: dict[int, int] = {}
    if max_row_bytes is not None and len(cols) > 1:
        sizes = frame.select(_row_bytes(frame.schema, cols[1:])).to_series()
        big = sizes > max_row_bytes
        if big.any():
            too_large = {i: sizes[i] for i in big.arg_true().to_list()}
            frame = frame.with_columns(  # the text stays in Arrow, never becomes str objects
                pl.when(big).then(None).otherwise(pl.col(c)).alias(c) for c in cols[1:]
            )
    records = list(frame.iter_rows(named=True))
    if len(records) != num_rows:  # the footer promised more rows than the pages hold
        raise pl.exceptions.ComputeError(f"decoded {len(records)} of {num_rows} rows")
    return records, too_large


def _row_bytes(schema: pl.Schema, cols: list[str]) -> pl.Expr:
    """Per row, the bytes of text in `cols`: strings, binaries and lists of strings (a score
    job's candidates); other types (numbers, dates) count 0, being small and fixed-size."""
    import polars as pl

    parts = []
    for c in cols:
        dtype = schema[c]
        if dtype in (pl.String, pl.Categorical) or isinstance(dtype, (pl.Categorical, pl.Enum)):
            parts.append(pl.col(c).cast(pl.String).str.len_bytes())
        elif dtype == pl.Binary:
            parts.append(pl.col(c).bin.size())
        elif isinstance(dtype, (pl.List, pl.Array)) and dtype.inner == pl.String:
            parts.append(
                pl.col(c)
                .cast(pl.List(pl.String))
                .list.eval(pl.element().str.len_bytes())
                .list.sum()
            )
    if not parts:
        return pl.lit(0, dtype=pl.Int64).alias("bytes")
    return pl.sum_horizontal(p.cast(pl.Int64).fill_null(0) for p in parts).alias("bytes")


def _salvage(
    path: str,
    lf: pl.LazyFrame,
    cols: list[str],
    start: int,
    num_rows: int,
    max_row_bytes: int | None,
):
    pieces = []
    for a, b, group in _split_at_row_groups(path, start, start + num_rows):
        try:
            pieces.append(_piece(lf, cols, a, b - a, max_row_bytes))
        except _decode_errors() as e:
            try:
                ids = [r[cols[0]] for r in _decode(lf, cols[:1], a, b - a, None)[0]]
            except _decode_errors():
                ids = None
            pieces.append(Piece(a, b - a, None, ids, _first_line(e), group))
    return pieces


def _split_at_row_groups(path: str, start: int, stop: int):
    """[start, stop) cut at the file's row-group boundaries: (a, b, (first, last row of the
    row group)) triples; one piece of the whole range if the footer cannot say."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    except Exception:
        return [(start, stop, (start, stop - 1))]
    out, first = [], 0
    for size in sizes:
        a, b = max(start, first), min(stop, first + size)
        if a < b:
            out.append((a, b, (first, first + size - 1)))
        first += size
    return out if out and out[-1][1] == stop else [(start, stop, (start, stop - 1))]


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= 200 else text[:197] + "..."
