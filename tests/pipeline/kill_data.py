"""Kill-and-resume inputs: good rows with bad ones scattered through, and what the output owes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

WORDS = (
    "the river city council music festival bakery library farmer students bus market solar "
    "roof museum club weather volunteers season"
).split()
SHARD_ROWS = 20
# Small engine limits keep the tiny model fast on CPU; max_model_len makes LONG a row error.
ENGINE = {"max_num_seqs": 16, "num_kv_blocks": 256, "max_model_len": 128, "dtype": "float32"}
LONG = " ".join(["word"] * 400)  # several hundred tokens: prompt_too_long

# One output row is owed per input row: (id or None, error_code or None), in input order.
Expected = list[tuple[str | None, str | None]]


def good_rows(n: int, rng: random.Random) -> list[dict]:
    return [
        {"id": f"r{i:05d}", "topic": rng.choice("abc"), "text": " ".join(rng.sample(WORDS, 6))}
        for i in range(n)
    ]


def scatter(rows: list, bad: list, rng: random.Random) -> list:
    """Insert each bad row at a seeded position, so they land in several shards."""
    out = list(rows)
    for b in bad:
        out.insert(rng.randrange(len(out) + 1), b)
    return out


def write_jsonl(path: Path, n: int, seed: int) -> Expected:
    """n good rows plus one row of each error kind a JSONL reader or the planner reports."""
    rng = random.Random(seed)
    good = [json.dumps(r) for r in good_rows(n, rng)]
    bad = [
        ('{"id": "broken", "text": "unterminated', (None, "bad_json")),
        ("not json at all", (None, "bad_json")),
        (json.dumps({"text": "no id", "topic": "a"}), (None, "missing_id")),
        (json.dumps({"id": "r00003", "text": "again", "topic": "b"}), ("r00003", "duplicate_id")),
        (json.dumps({"id": "nul", "text": None, "topic": "c"}), ("nul", "null_text")),
        (json.dumps({"id": "long", "text": LONG, "topic": "a"}), ("long", "prompt_too_long")),
    ]
    lines = scatter([(g, (json.loads(g)["id"], None)) for g in good], bad, rng)
    path.write_text("".join(line + "\n" for line, _ in lines))
    return [want for _, want in lines]


def write_parquet(path: Path, n: int, seed: int) -> Expected:
    """n good rows plus the error kinds a well-formed Parquet file can still hold."""
    rng = random.Random(seed)
    bad = [
        ({"id": "r00004", "topic": "b", "text": "again"}, ("r00004", "duplicate_id")),
        ({"id": "nul", "topic": "c", "text": None}, ("nul", "null_text")),
        ({"id": "long", "topic": "a", "text": LONG}, ("long", "prompt_too_long")),
    ]
    rows = scatter([(r, (r["id"], None)) for r in good_rows(n, rng)], bad, rng)
    table = pa.Table.from_pylist([r for r, _ in rows])
    pq.write_table(table, path, row_group_size=64)  # several row groups per file
    return [want for _, want in rows]


def write_job(root: Path, model: str, input_name: str) -> Path:
    job = {
        "model": {"path": model, **ENGINE},
        "input": {"path": input_name, "columns": ["topic"]},
        "prompt": {"template": "Summarize: {text}\nSummary:"},
        "sampling": {"max_tokens": 8, "temperature": 0.0, "seed": 0},
        "output": {"path": "out", "shard_rows": SHARD_ROWS},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path
