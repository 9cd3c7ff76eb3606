"""One output file from a finished job's shards: parts concatenated in input order, atomically.

`batchgen run-batch` keeps its resumable state in a normal sharded output directory and, once
every shard is committed, writes the single file the user asked for (JSONL lines or Parquet),
plus the OpenAI batch errors file: the lines whose request failed, as OpenAI's batch API keeps
them in a file of their own.
"""

from __future__ import annotations

import glob
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.io import atomic


def part_files(parts_dir: str, ext: str) -> list[str]:
    """The committed shard files (`part-NNNNN.<ext>`), in shard order: input order."""
    return sorted(glob.glob(os.path.join(glob.escape(parts_dir), f"part-[0-9]*.{ext}")))


def errors_path(out: str) -> str:
    """Where the errors of OUT go: `results.jsonl` -> `results.errors.jsonl`."""
    root, ext = os.path.splitext(out)
    return f"{root}.errors{ext}" if ext else f"{out}.errors.jsonl"


def _commit_with(final: str, write) -> None:
    tmp = atomic.temp_path(final)
    try:
        write(tmp)
        atomic.commit(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def concat_jsonl(parts: list[str], out: str, errors_out: str | None = None) -> int:
    """Concatenate JSONL parts into `out`; lines with a non-null "error" (OpenAI batch lines)
    are also written to `errors_out` (removed when there are none). Returns the error count."""
    errors: list[bytes] = []

    def write(tmp: str) -> None:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    for line in src:
                        dst.write(line)
                        if errors_out is not None and json.loads(line).get("error") is not None:
                            errors.append(line)

    def write_errors(tmp: str) -> None:
        with open(tmp, "wb") as dst:
            dst.writelines(errors)

    _commit_with(out, write)
    if errors_out is not None:
        if errors:
            _commit_with(errors_out, write_errors)
        elif os.path.exists(errors_out):
            os.unlink(errors_out)  # an earlier run's; this run has no errors
    return len(errors)


def concat_parquet(parts: list[str], out: str) -> None:
    """Concatenate Parquet parts (one schema, which every shard of a job shares) into `out`,
    one part at a time (no parts: an empty file with an `id` column)."""

    def write(tmp: str) -> None:
        if not parts:
            pq.write_table(pa.table({"id": pa.array([], pa.string())}), tmp)
            return
        writer = None
        try:
            for part in parts:
                table = pq.read_table(part)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()

    _commit_with(out, write)
