"""Readers: stream input rows from Parquet / JSONL / OpenAI-batch files in bounded chunks."""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from typing import Any

from batchgen.io.json_line import BOM, NotText, loads
from batchgen.io.parquet_chunks import Piece, read_chunks
from batchgen.io.parquet_schema import parquet_schema
from batchgen.io.rows import InputRow
from batchgen.job import InputSpec, JobError
from batchgen.job.spec import DEFAULT_MAX_ROW_BYTES
from batchgen.short_repr import short_repr

OPENAI_KEY = "__openai__"  # data key holding an OpenAI batch line's {url, body}
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
_EXTS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}


def resolve_inputs(path: str) -> list[str]:
    """Input files for `input.path`: a file, a directory (its .parquet/.jsonl files) or a glob.

    Names starting with "." or "_" (temp files, _SUCCESS, manifests) are skipped in directories
    and globs. Files are processed in sorted path order.
    """
    if os.path.isdir(path):
        found = [
            os.path.join(path, f)
            for f in os.listdir(path)
            if os.path.splitext(f)[1] in _EXTS and not f.startswith((".", "_"))
        ]
    elif os.path.isfile(path):
        found = [path]
    else:
        found = [
            f
            for f in glob.glob(path, recursive=True)
            if not os.path.basename(f).startswith((".", "_"))
        ]
    # Only regular files (symlinks followed): a subdirectory named like an input is skipped;
    # a symlink to nothing is an error, since the data it stood for would be silently missing.
    for f in found:
        if os.path.islink(f) and not os.path.exists(f):
            raise JobError(f"input.path: {f} is a symlink to a missing file")
    files = [f for f in found if os.path.isfile(f)]
    if not files:
        raise JobError(f"input.path: {path!r} matches no input files")
    return sorted(files)


def file_format(path: str, fmt: str) -> str:
    """The format of one file: the job's `input.format`, or detected from name and first line."""
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTS:
        raise JobError(f"input.format: cannot tell the format of {path!r}; set input.format")
    if _EXTS[ext] == "parquet":
        return "parquet"
    first = _first_object(path)
    if first is not None and "custom_id" in first and "body" in first:
        return "openai-batch"
    return "jsonl"


def _first_object(path: str, limit: int = 100) -> dict | None:
    for obj in _sample_objects(path, limit):
        return obj
    return None


def id_text(value: Any) -> str | None:
    """A row id as text: a string as is, an integer in decimal (so 7 and "7" are one id); None
    for any other value (bool, float, list, object), which has no one obvious text."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _bad_id_message(key: str, value: Any) -> str:
    kind = type(value).__name__
    return f"id {key!r} must be a string or an integer, got {kind} {short_repr(value)}"


def bounded_lines(f, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, line, size) for each line of binary file `f`, without its newline and
    the file's BOM; a line over `limit` bytes comes as None (with its size), read past in
    1 MiB pieces and never held whole."""
    lineno = 0
    while True:
        line = f.readline(limit + 2)  # room for the content, "\r" and "\n"
        if not line:
            return
        lineno += 1
        if lineno == 1:
            line = line.removeprefix(BOM)
        if line.endswith(b"\n") or len(line) <= limit:
            content = line.rstrip(b"\r\n")
            if len(content) <= limit:
                yield lineno, content, len(content)
                continue
        size = len(line.rstrip(b"\r\n"))
        while not line.endswith(b"\n"):
            line = f.readline(1 << 20)
            if not line:
                break
            size += len(line.rstrip(b"\r\n"))
        yield lineno, None, size


def _sample_objects(
    path: str, limit: int, max_bytes: int = DEFAULT_MAX_ROW_BYTES
) -> Iterator[dict]:
    """The JSON objects among the first `limit` lines (lines over `max_bytes` skipped)."""
    with open(path, "rb") as f:
        for lineno, line, _ in bounded_lines(f, max_bytes):
            if lineno > limit:
                return
            if line is None:
                continue
            try:
                obj = loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def check_columns(files: list[str], spec: InputSpec, needed: list[str]) -> None:
    """Refuse a job whose columns are absent from the input, before any model loads.

    Parquet files are checked against their schema (and their id column must hold strings or
    integers); JSONL files against the keys of their first 100 readable rows (a single row
    missing a column later is a row error, not a job error).
    """
    for path in files:
        fmt = file_format(path, spec.format)
        if fmt == "parquet":
            try:
                schema = parquet_schema(path)
            except Exception as e:
                raise JobError(f"input.path: {path} is not readable Parquet ({e})") from None
            names = set(schema)
            want = [spec.id_column, *needed]
            _check_id_dtype(path, spec.id_column, schema.get(spec.id_column))
        elif fmt == "jsonl":
            names = set()
            for obj in _sample_objects(path, 100, spec.max_row_bytes):
                names.update(obj)
            if not names:
                continue
            want = list(needed)
        else:
            continue
        missing = [c for c in want if c not in names]
        if missing:
            raise JobError(
                f"input: column(s) {', '.join(map(repr, missing))} used by the job are not in "
                f"{path} (its columns: {', '.join(sorted(names))})"
            )


def _check_id_dtype(path: str, column: str, dtype) -> None:
    # Every row of a column of another type would be a bad_id row: refuse the job instead.
    import polars as pl  # here, not at the top: importing the reader must not need polars

    ok = dtype is None or dtype == pl.Null or dtype.is_integer()
    if not ok and not isinstance(dtype, (pl.String, pl.Categorical, pl.Enum)):
        raise JobError(
            f"input: id column {column!r} in {path} is {dtype}; ids must be strings or "
            "integers (cast the column, or pick another id column)"
        )


class Reader:
    """Iterates all input rows in order, in chunks of at most `chunk_rows` rows.

    Duplicate ids are flagged here (first occurrence wins), so every task of a sharded job sees
    the same verdict; the seen-id set keeps an 8-byte digest per row.
    """

    def __init__(self, files: list[str], spec: InputSpec, columns: list[str], chunk_rows=1024):
        self.files = files
        self.spec = spec
        self.columns = list(dict.fromkeys(c for c in columns if c != spec.id_column))
        self.chunk_rows = chunk_rows
        self._seen: set[bytes] = set()
        self._next_index = 0

    def __iter__(self) -> Iterator[list[InputRow]]:
        for path in self.files:
            fmt = file_format(path, self.spec.format)
            chunks = self._parquet(path) if fmt == "parquet" else self._jsonl(path, fmt)
            for chunk in chunks:
                yield [self._dedup(r) for r in chunk]

    def _new_row(self, **kw) -> InputRow:
        row = InputRow(index=self._next_index, **kw)
        self._next_index += 1
        return row

    def _dedup(self, row: InputRow) -> InputRow:
        if row.error_code is None and row.id is not None:
            key = hashlib.blake2b(row.id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            if key in self._seen:
                row.error_code = "duplicate_id"
                row.error = f"{row.source}: id {row.id!r} appeared earlier; first occurrence wins"
            self._seen.add(key)
        return row

    def _parquet(self, path: str) -> Iterator[list[InputRow]]:
        key, limit = self.spec.id_column, self.spec.max_row_bytes
        for pieces in read_chunks(path, key, self.columns, self.chunk_rows, limit):
            rows = []
            for piece in pieces:
                for i in range(piece.num_rows):
                    source = f"{path}:row {piece.start + i}"
                    if piece.records is None:
                        rows.append(self._undecodable(piece, i, source))
                    elif i in piece.too_large:
                        row_id = id_text(piece.records[i].get(key))
                        what = f"its text columns hold {piece.too_large[i]:,} bytes"
                        rows.append(self._too_large(source, what, row_id or None))
                    else:
                        rows.append(self._make_row(piece.records[i], source))
            yield rows

    def _undecodable(self, piece: Piece, i: int, source: str) -> InputRow:
        first, last = piece.damaged or (piece.start, piece.start + piece.num_rows - 1)
        message = f"rows {first}-{last} of this file cannot be decoded ({piece.error})"
        row_id = id_text(piece.ids[i]) if piece.ids is not None else None
        return self._bad(source, "bad_parquet", message, row_id=row_id or None)

    def _jsonl(self, path: str, fmt: str) -> Iterator[list[InputRow]]:
        rows: list[InputRow] = []
        limit = self.spec.max_row_bytes
        with open(path, "rb") as f:
            for lineno, raw, size in bounded_lines(f, limit):
                source = f"{path}:{lineno}"
                if raw is None:
                    rows.append(self._too_large(source, f"line is {size:,} bytes"))
                elif not raw.strip():
                    continue
                else:
                    rows.append(self._parse_line(raw, source, fmt))
                if len(rows) >= self.chunk_rows:
                    yield rows
                    rows = []
        if rows:
            yield rows

    def _too_large(self, source: str, what: str, row_id: str | None = None) -> InputRow:
        limit = self.spec.max_row_bytes
        return self._bad(
            source,
            "row_too_large",
            f"{what}, over input.max_row_bytes={limit:,}; shorten the row or raise the limit",
            row_id=row_id,
        )

    def _parse_line(self, raw: bytes, source: str, fmt: str) -> InputRow:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return self._bad(source, "invalid_utf8", f"line is not valid UTF-8 ({e.reason})")
        try:
            obj = loads(text)
        except NotText as e:
            return self._bad(source, "bad_json", f"line is JSON but not text: {e}")
        except ValueError as e:
            return self._bad(source, "bad_json", f"line is not valid JSON ({e})")
        if not isinstance(obj, dict):
            return self._bad(source, "bad_json", "line is JSON but not an object")
        if fmt == "openai-batch":
            return self._openai_row(obj, source)
        return self._make_row(obj, source)

    def _bad(self, source: str, code: str, message: str, row_id=None) -> InputRow:
        return self._new_row(
            id=row_id, data=None, source=source, error_code=code, error=f"{source}: {message}"
        )

    def _make_row(self, rec: dict[str, Any], source: str) -> InputRow:
        key = self.spec.id_column
        raw_id = rec.get(key)
        if raw_id is None or raw_id == "":
            return self._bad(source, "missing_id", f"no {key!r} value")
        row_id = id_text(raw_id)
        if row_id is None:
            return self._bad(source, "bad_id", _bad_id_message(key, raw_id))
        data = {c: rec[c] for c in self.columns if c in rec}
        return self._new_row(id=row_id, data=data, source=source)

    def _openai_row(self, obj: dict[str, Any], source: str) -> InputRow:
        custom_id = obj.get("custom_id")
        if custom_id is None or custom_id == "":
            return self._bad(source, "missing_id", "no 'custom_id' value")
        row_id = id_text(custom_id)
        if row_id is None:
            return self._bad(source, "bad_id", _bad_id_message("custom_id", custom_id))
        url, body = obj.get("url"), obj.get("body")
        if url not in OPENAI_URLS or not isinstance(body, dict):
            return self._bad(
                source,
                "bad_params",
                f"url must be one of {', '.join(OPENAI_URLS)} and body an object (got {url!r})",
                row_id=row_id,
            )
        data = {c: obj[c] for c in self.columns if c in obj}
        data[OPENAI_KEY] = {"url": url, "body": body}
        return self._new_row(id=row_id, data=data, source=source)
