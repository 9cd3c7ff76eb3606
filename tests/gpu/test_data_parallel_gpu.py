"""On two GPUs: `batchgen run` of a 2,000-row job with data_parallel_size 2 (one engine per GPU,
shards from one queue) has every id exactly once and equals one GPU's output in fp32; in bf16
every id is once and where the texts first part is reported (`pytest -s` shows it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

REPO = Path(__file__).resolve().parents[2]
ROWS, SHARD_ROWS = 2000, 100
RUN_TIMEOUT_S = 900  # a bare machine compiles kernels at the first start
WORDS = "the river city council music festival bakery library farmer students bus market".split()
COLUMNS = ["id", "text", "finish_reason", "num_prompt_tokens", "num_output_tokens"]


def workspace(root: Path, model: str, dtype: str) -> Path:
    root.mkdir()
    rng = random.Random(0)
    with open(root / "in.jsonl", "w") as f:
        for i in range(ROWS):
            words = " ".join(rng.choices(WORDS, k=rng.randrange(3, 40)))
            f.write(json.dumps({"id": f"r{i:05d}", "text": words}) + "\n")
    job = {
        "model": {"path": model, "dtype": dtype, "device": "cuda", "max_num_seqs": 64,
                  "num_kv_blocks": 4096, "max_model_len": 256},
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "Summarize: {text}\nSummary:"},
        "sampling": {"max_tokens": 32, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": SHARD_ROWS},
    }  # fmt: skip
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root / "job.yaml"


def run(job: Path, out: str, data_parallel: int) -> tuple[dict[str, list], str]:
    """`batchgen run` into `out` with that many engines: the output's columns, its log."""
    sizes = f"model.data_parallel_size={data_parallel}"
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--no-progress",
           "--set", f"output.path={out}", "--set", sizes]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        cmd, cwd=job.parent, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    columns: dict[str, list] = {c: [] for c in COLUMNS}
    for f in sorted((job.parent / out).glob("part-*.parquet")):  # shards in input order
        t = pq.read_table(f, columns=COLUMNS)
        for c in COLUMNS:
            columns[c] += t.column(c).to_pylist()
    return columns, log


def first_difference(a: str | None, b: str | None) -> int | None:
    if a == b:
        return None
    a, b = a or "", b or ""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_equal_one(tmp_path, tiny_model_dir, dtype):
    job = workspace(tmp_path / dtype, tiny_model_dir("llama"), dtype)
    one, _ = run(job, "out1", 1)
    two, log = run(job, "out2", 2)
    ids = [f"r{i:05d}" for i in range(ROWS)]
    assert one["id"] == ids and two["id"] == ids  # every id exactly once, in input order
    assert "data parallel: 2 engine workers (GPU 0, GPU 1)" in log
    assert "[worker 0] shard " in log and "[worker 1] shard " in log, log[-4000:]
    differ = {
        i: first_difference(one["text"][i], two["text"][i])
        for i in range(ROWS)
        if one["text"][i] != two["text"][i]
    }
    print(f"\n{dtype}: {len(differ)} of {ROWS} texts differ from one GPU's", end="")
    if differ:
        positions = sorted(differ.values())
        print(f"; first differing character: min {positions[0]}, median "
              f"{positions[len(positions) // 2]}; rows {sorted(differ)[:10]}")  # fmt: skip
    if dtype == "float32":
        assert not differ, f"rows whose texts differ (row: first differing character): {differ}"
        for column in COLUMNS[2:]:
            assert one[column] == two[column], column
