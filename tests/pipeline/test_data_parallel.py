"""`batchgen run` with data_parallel_size 2 on the tiny model (CPU, two engine worker
processes): the output equals one engine's; a worker SIGKILLed mid-run leaves its shards to the
other and the run still ends with every row exactly once; SIGTERM to the parent reaches both
workers, exits 75, and a rerun completes the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from workspace import TEMPLATE, read_output, rows, write_jsonl

from batchgen.job import load_job
from batchgen.pipeline.runner import Runner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
ROWS, SHARD_ROWS = 600, 50
ENGINE = {"max_num_seqs": 8, "num_kv_blocks": 256, "max_model_len": 128, "dtype": "float32"}
DEADLINE_S = 600  # only a hang reaches it


def workspace(root: Path, model: str, data_parallel: int) -> Path:
    write_jsonl(root / "in.jsonl", rows(ROWS))
    job = {
        "model": {"path": model, "device": "cpu", "data_parallel_size": data_parallel, **ENGINE},
        "input": {"path": "in.jsonl", "columns": ["topic"]},
        "prompt": {"template": TEMPLATE},
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": SHARD_ROWS},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root / "job.yaml"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """One engine's output (data_parallel_size 1, in this process)."""
    root = tmp_path_factory.mktemp("dp1")
    job = load_job(str(workspace(root, tiny_model_dir("llama"), 1)))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert Runner(job).run().exit_code == 0
    finally:
        os.chdir(cwd)
    return read_output(root / "out").drop("num_cached_tokens")


def start(job: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = job.parent / f"log-{time.monotonic_ns()}.txt"
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--no-progress", *args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=job.parent, env=ENV, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    code = proc.wait(timeout=DEADLINE_S)
    return code, log.read_text(errors="replace")


def poll(what: str, found, proc: subprocess.Popen, log: Path):
    """found() until it is truthy (a failed run or the deadline fails the test)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {DEADLINE_S} s:\n{log.read_text()}")


def committed(out: Path) -> int:
    d = out / "_manifest"
    return len(list(d.glob("part-*.json"))) if d.is_dir() else 0


def worker_holding_a_shard(out: Path, parent: int) -> int | None:
    """The pid of a worker of `parent` that holds a shard lock now."""
    for lock in sorted((out / "_locks").glob("part-*.lock")):
        try:
            pid = json.loads(lock.read_text())["pid"]
            with open(f"/proc/{pid}/status") as f:
                ppid = int(next(x for x in f if x.startswith("PPid:")).split()[1])
        except (OSError, ValueError, KeyError, StopIteration):
            continue  # released or gone meanwhile
        if ppid == parent:
            return pid
    return None


def check_output(out: Path, reference) -> None:
    got = read_output(out).drop("num_cached_tokens")
    assert got["id"].to_list() == [r["id"] for r in rows(ROWS)]  # each once, in input order
    assert got.equals(reference)
    assert (out / "_SUCCESS").exists() and not (out / "_locks").exists()


def test_two_workers_equal_one_engine(tmp_path, tiny_model_dir, reference):
    job = workspace(tmp_path, tiny_model_dir("llama"), 2)
    code, log = finish(*start(job))
    assert code == 0, log
    assert "data parallel: 2 engine workers (cpu, cpu)" in log
    for i in (0, 1):  # both engines ran shards
        assert f"[worker {i}] shard " in log, log
    assert f"shards committed: {ROWS // SHARD_ROWS}/{ROWS // SHARD_ROWS} (this run: 12" in log
    assert f"rows: {ROWS} ok, 0 error(s)" in log
    check_output(tmp_path / "out", reference)
    stats = json.loads((tmp_path / "out" / "_stats.json").read_text())
    assert stats["last_run"]["rows_ok"] == ROWS  # the parent's totals cover both workers


def test_sigkill_to_one_worker_mid_run(tmp_path, tiny_model_dir, reference):
    job = workspace(tmp_path, tiny_model_dir("llama"), 2)
    out = tmp_path / "out"
    proc, log = start(job, "--checkpoint", "1")
    poll("a committed shard", lambda: committed(out), proc, log)
    victim = poll(
        "a worker holding a shard", lambda: worker_holding_a_shard(out, proc.pid), proc, log
    )
    os.kill(victim, signal.SIGKILL)
    code, text = finish(proc, log)
    assert code == 0, text
    assert f"(cpu, pid {victim}) was killed by SIGKILL while holding shard(s)" in text, text
    assert "goes back to the queue for another worker" in text
    check_output(out, reference)


def test_sigterm_to_the_parent_then_resume(tmp_path, tiny_model_dir, reference):
    job = workspace(tmp_path, tiny_model_dir("llama"), 2)
    out = tmp_path / "out"
    proc, log = start(job)
    workers = poll("two workers", lambda: _workers(log), proc, log)
    loaded = ("[worker 0] model loaded", "[worker 1] model loaded")  # both in their shard loop
    poll("both models", lambda: all(x in log.read_text() for x in loaded), proc, log)
    poll("a committed shard", lambda: committed(out), proc, log)
    proc.send_signal(signal.SIGTERM)
    code, text = finish(proc, log)
    assert code == 75, text
    assert "interrupted by SIGTERM" in text
    assert text.count("SIGTERM: no new rows") == 2, text  # each worker stopped gracefully
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    assert committed(out) < ROWS // SHARD_ROWS, "the run finished before its signal"
    code, text = finish(*start(job))
    assert code == 0, text
    check_output(out, reference)


def _workers(log: Path) -> list[int]:
    pids = [
        int(line.split("pid ")[1].split(")")[0])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("data parallel: worker ") and line.endswith(" started")
    ]
    return pids if len(pids) == 2 else []
