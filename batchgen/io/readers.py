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
from batchgen.io.rows import InputRow, Position
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
    for lineno, _, content, size in lines_from(f, limit):
        yield lineno, content, size


def lines_from(
    f, limit: int, offset: int = 0, lineno: int = 1, stop: int | None = None
) -> Iterator[tuple[int, int, bytes | None, int]]:
    """(line number, byte offset, line, size) for each line of binary file `f` from byte
    `offset` on (the start of line `lineno`) to the line starting at or past `stop`, as
    bounded_lines gives them; the offset is where the line starts in the file, so a reader
    can later seek back to it."""
    f.seek(offset)
    while stop is None or offset < stop:
        at = offset
        # Room for the content, "\r" and "\n" (and the BOM, which is no content).
        line = f.readline(limit + 2 + (len(BOM) if at == 0 else 0))
        if not line:
            return
        offset += len(line)
        if at == 0:
            line = line.removeprefix(BOM)
        if line.endswith(b"\n") or len(line) <= limit:
            content = line.rstrip(b"\r\n")
            if len(content) <= limit:
                yield lineno, at, content, len(content)
                lineno += 1
                continue
        size = len(line.rstrip(b"\r\n"))
        while not line.endswith(b"\n"):
            line = f.readline(1 << 20)
            if not line:
                break
            offset += len(line)
            size += len(line.rstrip(b"\r\n"))
        yield lineno, at, None, size
        lineno += 1


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
    """Iterates input rows in order, in chunks of at most `chunk_rows` rows.

    From the start, or from `start` (a Position from the job's shard plan) with `first_index`
    the index of the row there. Duplicate ids (first occurrence wins) come from `duplicates`,
    the plan's set of duplicate row indexes, so every task of a sharded job sees the same
    verdict without reading the rows before its own; without it (`dedup`) they are found here,
    keeping an 8-byte digest per row.
    """

    def __init__(
        self,
        files: list[str],
        spec: InputSpec,
        columns: list[str],
        chunk_rows=1024,
        start: Position | None = None,
        first_index: int = 0,
        duplicates: set[int] | None = None,
        dedup: bool = True,
        limit: int | None = None,
    ):
        self.files = files
        self.spec = spec
        self.columns = list(dict.fromkeys(c for c in columns if c != spec.id_column))
        self.chunk_rows = chunk_rows
        self.start = start or Position(0, 0, 1)
        self.duplicates = duplicates
        self.dedup = dedup and duplicates is None
        self._seen: set[bytes] = set()
        self._next_index = first_index
        self.stop_index = None if limit is None else first_index + limit

    def __iter__(self) -> Iterator[list[InputRow]]:
        for i in range(self.start.file, len(self.files)):
            path = self.files[i]
            at = self.start if i == self.start.file else Position(i, 0, 1)
            fmt = file_format(path, self.spec.format)
            chunks = self._parquet(at) if fmt == "parquet" else self._jsonl(at, fmt)
            for chunk in chunks:
                if self.stop_index is not None and chunk[-1].index >= self.stop_index - 1:
                    yield [self._dedup(r) for r in chunk if r.index < self.stop_index]
                    return
                yield [self._dedup(r) for r in chunk]

    def _new_row(self, **kw) -> InputRow:
        row = InputRow(index=self._next_index, **kw)
        self._next_index += 1
        return row

    def _dedup(self, row: InputRow) -> InputRow:
        if row.error_code is not None or row.id is None:
            return row
        if self.duplicates is not None:
            if row.index in self.duplicates:
                row.error_code = "duplicate_id"
                row.error = f"{row.source}: id {row.id!r} appeared earlier; first occurrence wins"
        elif self.dedup:
            key = hashlib.blake2b(row.id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            if key in self._seen:
                row.error_code = "duplicate_id"
                row.error = f"{row.source}: id {row.id!r} appeared earlier; first occurrence wins"
            self._seen.add(key)
        return row

    def _parquet(self, at: Position) -> Iterator[list[InputRow]]:
        path = self.files[at.file]
        key, limit = self.spec.id_column, self.spec.max_row_bytes
        size = self._chunk_size()
        for pieces in read_chunks(path, key, self.columns, size, limit, at.offset):
            rows = []
            for piece in pieces:
                for i in range(piece.num_rows):
                    source = f"{path}:row {piece.start + i}"
                    if piece.records is None:
                        row = self._undecodable(piece, i, source)
                    elif i in piece.too_large:
                        row_id = id_text(piece.records[i].get(key))
                        what = f"its text columns hold {piece.too_large[i]:,} bytes"
                        row = self._bad(
                            source, "row_too_large", too_large(what, limit), row_id or None
                        )
                    else:
                        row = self._make_row(piece.records[i], source)
                    row.pos = Position(at.file, piece.start + i, 0)
                    rows.append(row)
            yield rows

    def _undecodable(self, piece: Piece, i: int, source: str) -> InputRow:
        first, last = piece.damaged or (piece.start, piece.start + piece.num_rows - 1)
        message = f"rows {first}-{last} of this file cannot be decoded ({piece.error})"
        row_id = id_text(piece.ids[i]) if piece.ids is not None else None
        return self._bad(source, "bad_parquet", message, row_id=row_id or None)

    def _jsonl(self, at: Position, fmt: str) -> Iterator[list[InputRow]]:
        path = self.files[at.file]
        rows: list[InputRow] = []
        limit = self.spec.max_row_bytes
        with open(path, "rb") as f:
            for lineno, start, raw, size in lines_from(f, limit, at.offset, at.line):
                if raw is not None and not raw.strip():
                    continue
                row = self._parse_line(raw, size, f"{path}:{lineno}", fmt)
                row.pos = Position(at.file, start, lineno)
                rows.append(row)
                if len(rows) >= self._chunk_size():
                    yield rows
                    rows = []
        if rows:
            yield rows

    def _chunk_size(self) -> int:
        """chunk_rows, or fewer to end at the limit: no line past it is read."""
        if self.stop_index is None:
            return self.chunk_rows
        return max(1, min(self.chunk_rows, self.stop_index - self._next_index))

    def _parse_line(self, raw: bytes | None, size: int, source: str, fmt: str) -> InputRow:
        key, limit = self.spec.id_column, self.spec.max_row_bytes
        row_id, data, code, message = parse_line(raw, fmt, key, self.columns, size, limit)
        if code is not None:
            return self._bad(source, code, str(message), row_id=row_id)
        return self._new_row(id=row_id, data=data, source=source)

    def _bad(self, source: str, code: str, message: str, row_id=None) -> InputRow:
        return self._new_row(
            id=row_id, data=None, source=source, error_code=code, error=f"{source}: {message}"
        )

    def _make_row(self, rec: dict[str, Any], source: str) -> InputRow:
        row_id, data, code, message = record_fields(rec, self.spec.id_column, self.columns)
        if code is not None:
            return self._bad(source, code, str(message), row_id=row_id)
        return self._new_row(id=row_id, data=data, source=source)


# (id, data, error_code, message): one input row's fields, or why it is an error record.
Fields = tuple[str | None, dict[str, Any] | None, str | None, str | None]


def too_large(what: str, limit: int) -> str:
    """The message of a row_too_large record."""
    return f"{what}, over input.max_row_bytes={limit:,}; shorten the row or raise the limit"


def parse_line(
    raw: bytes | None,
    fmt: str,
    id_column: str,
    columns: list[str],
    size: int = 0,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
) -> Fields:
    """One non-blank JSONL (or OpenAI batch) line as lines_from gives it: its id and the
    `columns` it holds, or the error it is (None: the line is `size` bytes, over
    `max_row_bytes`: row_too_large). The one definition of a line's verdict: the Reader and
    the shard plan's scan both use it, so a plan and a run agree on every row."""
    if raw is None:
        return None, None, "row_too_large", too_large(f"line is {size:,} bytes", max_row_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, None, "invalid_utf8", f"line is not valid UTF-8 ({e.reason})"
    try:
        obj = loads(text)
    except NotText as e:
        return None, None, "bad_json", f"line is JSON but not text: {e}"
    except ValueError as e:
        return None, None, "bad_json", f"line is not valid JSON ({e})"
    if not isinstance(obj, dict):
        return None, None, "bad_json", "line is JSON but not an object"
    if fmt == "openai-batch":
        return _openai_fields(obj, columns)
    return record_fields(obj, id_column, columns)


def record_fields(rec: dict[str, Any], key: str, columns: list[str]) -> Fields:
    """A record's id and `columns`, or its missing_id / bad_id error."""
    raw_id = rec.get(key)
    if raw_id is None or raw_id == "":
        return None, None, "missing_id", f"no {key!r} value"
    row_id = id_text(raw_id)
    if row_id is None:
        return None, None, "bad_id", _bad_id_message(key, raw_id)
    return row_id, {c: rec[c] for c in columns if c in rec}, None, None


def _openai_fields(obj: dict[str, Any], columns: list[str]) -> Fields:
    custom_id = obj.get("custom_id")
    if custom_id is None or custom_id == "":
        return None, None, "missing_id", "no 'custom_id' value"
    row_id = id_text(custom_id)
    if row_id is None:
        return None, None, "bad_id", _bad_id_message("custom_id", custom_id)
    url, body = obj.get("url"), obj.get("body")
    if url not in OPENAI_URLS or not isinstance(body, dict):
        message = f"url must be one of {', '.join(OPENAI_URLS)} and body an object (got {url!r})"
        return row_id, None, "bad_params", message
    data = {c: obj[c] for c in columns if c in obj}
    data[OPENAI_KEY] = {"url": url, "body": body}
    return row_id, data, None, None
