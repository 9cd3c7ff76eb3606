"""Parquet schemas read once per file version: the job's column check (prepare) and the output
layout's passthrough types both need every input file's schema, and a job of thousands of
files (or files on a network filesystem) should not read each footer twice."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa


def parquet_schema(path: str) -> dict[str, pl.DataType]:
    """{column: dtype} of a Parquet file, from its footer; cached until the file's size or
    mtime changes. Raises what polars raises for an unreadable file (not cached)."""
    st = os.stat(path)
    return dict(_read(os.path.realpath(path), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=16384)
def _read(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, pl.DataType], ...]:
    # size and mtime_ns are part of the key only: a rewritten file is read again.
    import polars as pl

    return tuple(pl.read_parquet_schema(path).items())


def arrow_schema(path: str) -> dict[str, pa.DataType]:
    """{column: Arrow type} of a Parquet file, from its footer (cached like parquet_schema)."""
    st = os.stat(path)
    return dict(_read_arrow(os.path.realpath(path), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=16384)
def _read_arrow(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, pa.DataType], ...]:
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    return tuple((f.name, f.type) for f in schema)
