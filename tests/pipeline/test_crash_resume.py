"""Kill -9 / SIGTERM during a run in a subprocess; the same command again must finish the job."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.pipeline.runner import Runner

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
# Waits on a run: generous, so a loaded machine never fails a test that a hang would.
DEADLINE_S = 300


def start(job_file: Path, cwd: Path, delay: float, **env) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.Popen(
        [sys.executable, str(DRIVER), str(job_file), str(delay)],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def reference(tmp_path: Path, data: list[dict]) -> dict[str, str]:
    ref = tmp_path / "ref"
    ref.mkdir()
    write_jsonl(ref / "in.jsonl", data)
    job = make_job(ref, "in.jsonl", output={"shard_rows": 20})
    cwd = os.getcwd()
    os.chdir(ref)
    try:
        Runner(
            load(job),
            engine_factory=lambda j: FakeEngine(max_num_seqs=8),
            tokenizer_factory=lambda j: FakeTokenizer(),
        ).run()
        df = read_output("out")
    finally:
        os.chdir(cwd)
    return dict(zip(df["id"].to_list(), df["text"].to_list()))


def check_complete(out: Path, data: list[dict], expected: dict[str, str]) -> None:
    assert (out / "_SUCCESS").exists()
    for f in out.glob("part-*.parquet"):
        pq.read_metadata(f)
    assert not [p for p in os.listdir(out) if ".tmp-" in p]
    df = read_output(out)
    assert df["id"].to_list() == [r["id"] for r in data]
    assert dict(zip(df["id"].to_list(), df["text"].to_list())) == expected


def wait_until(proc: subprocess.Popen, ready, what: str) -> bool:
    """Poll until `ready()`; False if the process ended first. The deadline only catches a hang:
    on a loaded 2-core machine a run's start-up alone can take several seconds."""
    deadline = time.monotonic() + DEADLINE_S
    while proc.poll() is None:
        if ready():
            return True
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S} s"
        time.sleep(0.005)
    return False


def num_entries(out: Path) -> int:
    """Shards committed so far: manifest entries renamed into place (temps start with '.')."""
    manifest = out / "_manifest"
    if not manifest.exists():
        return 0
    return len([n for n in os.listdir(manifest) if not n.startswith(".")])


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path):
    data = rows(800)  # 40 shards: the kills below leave most of them for the final run
    expected = reference(tmp_path, data)
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "in.jsonl", data)
    job = make_job(work, "in.jsonl", output={"shard_rows": 20})
    out = work / "out"
    rng = random.Random(7)
    # Kills timed from process start land in start-up (imports, preparation, planning) or
    # early in the run, wherever the machine's pace puts them; under load every one of them
    # can land before the run has created out/. Kills timed from the run's next committed
    # shard land mid-shard or mid-commit, and make sure shards exist for the debris below.
    moments = ["start"] * 4 + ["commit"] * 6
    rng.shuffle(moments)
    kills = 0
    for moment in moments:
        proc = start(job, work, delay=0.04)  # >= 0.2 s a shard: 5 steps of 0.04 s
        if moment == "start":
            ready = proc.poll() is None
            delay = rng.uniform(0.0, 0.8)
        else:
            target = num_entries(out) + 1
            ready = wait_until(proc, lambda t=target: num_entries(out) >= t, "committed shard")
            delay = rng.uniform(0.0, 0.15)
        time.sleep(delay)
        if ready and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=DEADLINE_S)
    # Each run ends by the kill: none can finish 40 shards within its moment.
    assert kills == len(moments)
    # The commit-timed kills each waited for a new shard; the job is left unfinished.
    committed = sorted(out.glob("part-*.parquet"))
    assert committed and not (out / "_SUCCESS").exists(), os.listdir(out)
    # Plant crash debris: a stray temp file and a committed shard truncated (no footer).
    (out / ".part-00001.parquet.tmp-999-dead").write_bytes(b"partial")
    victim = committed[0]
    victim.write_bytes(victim.read_bytes()[:40])
    final = start(job, work, delay=0.0)
    stderr = final.communicate(timeout=DEADLINE_S)[1].decode()
    assert final.returncode == 0, stderr
    check_complete(out, data, expected)


def test_truncated_shard_and_stray_temp_are_redone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = rows(100)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 20}))

    def go():
        return Runner(
            job,
            engine_factory=lambda j: FakeEngine(max_num_seqs=8),
            tokenizer_factory=lambda j: FakeTokenizer(),
        ).run()

    go()
    expected = dict(zip(*read_output("out").select("id", "text").to_dict(as_series=False).values()))
    shard = tmp_path / "out/part-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:-10])
    stray = tmp_path / "out/.part-00004.parquet.tmp-1-abcd"
    stray.write_bytes(b"junk")
    (tmp_path / "out/_SUCCESS").unlink()
    result = go()
    assert result.stats.shards_committed == 1 and result.stats.shards_skipped == 4
    assert not stray.exists()
    check_complete(tmp_path / "out", data, expected)


@pytest.mark.slow
def test_sigterm_exits_75_then_rerun_completes(tmp_path):
    data = rows(400)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 20})
    proc = start(job, tmp_path, delay=0.02, GRACE_S="2")
    # A committed shard: the run is inside Runner.run, its stop handlers installed (a SIGTERM
    # before that, in imports, is not promised to exit 75).
    assert wait_until(proc, lambda: num_entries(tmp_path / "out") >= 1, "committed shard")
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=DEADLINE_S)[1]
    assert proc.returncode == 75, stderr.decode()
    assert not (tmp_path / "out/_SUCCESS").exists()
    assert b"SIGTERM" in stderr
    again = start(job, tmp_path, delay=0.0)
    stderr = again.communicate(timeout=DEADLINE_S)[1]
    assert again.returncode == 0, stderr.decode()
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in data]
