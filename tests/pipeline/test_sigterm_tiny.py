"""SIGTERM at random moments on the tiny model: each stop exits 75 within 10 s keeping every
finished row, and the resumed runs end with exactly the output of an uninterrupted run.

Prints, per signal, the rows the run had finished when it came and the rows it committed
(`pytest -s` shows them).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Each signal uses up about 1 s of generation plus the requests in the engine (up to 64): the
# rows must outlast ten of them on a fast machine too, or a late signal finds the job done.
ROWS, SHARD_ROWS, SIGNALS = 6000, 1000, 10
WORDS = "the river city council music festival bakery library farmer students bus market".split()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status"),
]


def workspace(root: Path, model: str) -> Path:
    root.mkdir()
    rng = random.Random(0)
    with open(root / "in.jsonl", "w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"id": f"r{i:05d}", "text": " ".join(rng.sample(WORDS, 6))}) + "\n")
    job = {
        "model": {"path": model, "max_num_seqs": 16, "num_kv_blocks": 256, "max_model_len": 128,
                  "dtype": "float32"},
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "Summarize: {text}\nSummary:"},
        "sampling": {"max_tokens": 8, "temperature": 0.0, "seed": 0},
        "output": {"path": "out", "shard_rows": SHARD_ROWS},
    }  # fmt: skip
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root / "job.yaml"


def start(job: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--no-progress"]
    return subprocess.Popen(
        cmd, cwd=job.parent, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def catching_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(x for x in f if x.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def committed_ids(out: Path) -> set[str]:
    """Ids in committed part files and pieces (each file listed by its entry)."""
    ids: set[str] = set()
    for d in (out / "_manifest", out / "_partial"):
        for entry in d.glob("part-*.json") if d.is_dir() else []:
            data = (
                d.parent / json.loads(entry.read_text())["file"]
                if d.name == "_manifest"
                else (d / json.loads(entry.read_text())["file"])
            )
            if data.exists():
                ids.update(pq.read_table(data, columns=["id"]).column("id").to_pylist())
    return ids


def table(out: Path):
    import polars as pl

    files = sorted(out.glob("part-*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files]).drop("num_cached_tokens")


def test_sigterm_at_random_moments_keeps_finished_rows(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    ref = start(workspace(tmp_path / "ref", model))
    assert ref.wait(timeout=600) == 0, ref.stdout.read()
    job = workspace(tmp_path / "w", model)
    out = job.parent / "out"
    rng = random.Random(11)
    report = []
    while len(report) < SIGNALS:
        before = committed_ids(out)  # what earlier runs committed
        proc = start(job)
        lines = []
        # Timed from the model's load (imports and the load take seconds on a loaded
        # machine): the signal lands while a shard's rows are generated, part of them done.
        for line in proc.stdout:
            lines.append(line)
            if "model loaded" in line:
                break
        assert catching_sigterm(proc.pid), "".join(lines)
        time.sleep(rng.uniform(0.0, 2.0))
        assert proc.poll() is None, "the run ended before its signal: too few rows left"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output = "".join(lines) + proc.communicate(timeout=60)[0]
        took = time.monotonic() - sent
        assert proc.returncode == 75 and took < 10, (proc.returncode, took, output)
        found = re.search(r"stop: (\d+) row\(s\) had finished in this run when the signal", output)
        finished = int(found.group(1)) if found else 0  # 0: stopped before any row was made
        kept = len(committed_ids(out) - before)
        report.append((round(took, 2), finished, kept))
        assert kept >= 0.9 * finished, (finished, kept, output)
    last = start(job)
    assert last.wait(timeout=600) == 0, last.stdout.read()
    print("\nSIGTERM: (seconds to exit 75, rows finished at the signal, rows committed)")
    for line in report:
        print("  ", line)
    got = table(out)
    assert got["id"].n_unique() == ROWS == got.height
    assert got.equals(table(tmp_path / "ref" / "out"))
    assert sum(f for _, f, _ in report) > 0
