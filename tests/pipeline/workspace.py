"""Test workspaces: a fake model dir, input files and a job file under a temp directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchgen.job import load_job

if TYPE_CHECKING:
    import polars as pl

# polars is imported where it is used: test modules importing these helpers must collect on a
# machine without polars (the GPU machine, `pytest -m gpu`).

TEMPLATE = "Summarize:\n{text}\nSummary:"


def rows(n: int, prefix: str = "r") -> list[dict]:
    return [
        {
            "id": f"{prefix}{i:05d}",
            "text": f"document {i} " + "word " * (i % 17),
            "topic": ["a", "b", "c"][i % 3],
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import polars as pl

    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(records).write_parquet(path)
    return path


def corrupt_column_chunk(path, row_group: int, column: int) -> None:
    """Overwrite the tail of one column chunk's data page (footer left intact)."""
    meta = pq.ParquetFile(path).metadata.row_group(row_group).column(column)
    start, size = meta.data_page_offset, meta.total_compressed_size
    data = bytearray(path.read_bytes())
    data[start + size // 2 : start + size - 2] = b"\xff" * (size - 2 - size // 2)
    path.write_bytes(bytes(data))


def write_row_groups(path, n: int, row_group_size: int):
    table = pa.table(
        {"id": [f"r{i}" for i in range(n)], "text": [f"text {i} " * 3 for i in range(n)]}
    )
    pq.write_table(
        table, path, row_group_size=row_group_size, use_dictionary=False, compression="zstd"
    )
    return path


def make_job(root: Path, input_path: str, name: str = "job.yaml", **sections) -> Path:
    """Write a job file under root (paths in it are relative to root, the test's CWD)."""
    (root / "model").mkdir(exist_ok=True)
    (root / "model" / "config.json").write_text('{"model_type": "fake"}')
    job = {
        "model": {"path": "model", "max_num_seqs": 8},
        "input": {"path": input_path, "columns": ["topic"]},
        "prompt": {"template": TEMPLATE},
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": 50},
    }
    for key, value in sections.items():
        if value is None:
            job.pop(key, None)
        elif key != "prompt" and isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    path = root / name
    path.write_text(yaml.safe_dump(job))
    return path


def load(path: Path, *overrides: str):
    return load_job(str(path), list(overrides))


def read_output(out_dir: str | os.PathLike) -> pl.DataFrame:
    import polars as pl

    files = sorted(Path(out_dir).glob("part-*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files]) if files else pl.DataFrame()
