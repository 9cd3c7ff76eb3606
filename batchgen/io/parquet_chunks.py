"""Parquet input in row chunks; rows that cannot be decoded are reported by range, not raised."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl

# What decoding a damaged file raises: ComputeError for a corrupt page or invalid UTF-8 in a
# string column (polars validates it, so no lone surrogate reaches Python), a Rust panic for
# stranger damage (PanicException is no Exception subclass), OSError for a failing disk.
_DECODE_ERRORS = (pl.exceptions.PolarsError, pl.exceptions.PanicException, OSError)


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


def read_chunks(
    path: str, id_column: str, columns: list[str], chunk_rows: int, first_row: int = 0
) -> Iterator[list[Piece]]:
    """Yields the file's rows from `first_row` on as lists of pieces of `chunk_rows` rows in
    all (the last fewer).

    The row count and row groups come from the footer, which must be readable (the job's
    column check reads it first); data pages are decoded chunk by chunk, and only the row
    groups a chunk's rows lie in are read.
    """
    lf = pl.scan_parquet(path)
    names = set(lf.collect_schema().names())
    cols = [id_column] + [c for c in columns if c in names]
    total = lf.select(pl.len()).collect().item()
    for start in range(first_row, total, chunk_rows):
        num_rows = min(chunk_rows, total - start)
        try:
            pieces = [Piece(start, num_rows, _decode(lf, cols, start, num_rows))]
        except _DECODE_ERRORS:
            pieces = _salvage(path, lf, cols, start, num_rows)
        yield pieces


def _decode(lf: pl.LazyFrame, cols: list[str], start: int, num_rows: int) -> list[dict]:
    records = list(lf.select(cols).slice(start, num_rows).collect().iter_rows(named=True))
    if len(records) != num_rows:  # the footer promised more rows than the pages hold
        raise pl.exceptions.ComputeError(f"decoded {len(records)} of {num_rows} rows")
    return records


def _salvage(path: str, lf: pl.LazyFrame, cols: list[str], start: int, num_rows: int):
    pieces = []
    for a, b, group in _split_at_row_groups(path, start, start + num_rows):
        try:
            pieces.append(Piece(a, b - a, _decode(lf, cols, a, b - a)))
        except _DECODE_ERRORS as e:
            try:
                ids = [r[cols[0]] for r in _decode(lf, cols[:1], a, b - a)]
            except _DECODE_ERRORS:
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
