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


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path):
    data = rows(400)
    expected = reference(tmp_path, data)
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "in.jsonl", data)
    job = make_job(work, "in.jsonl", output={"shard_rows": 20})
    rng = random.Random(7)
    kills = 0
    for _ in range(10):
        proc = start(job, work, delay=0.04)  # a full run takes ~4.5 s
        time.sleep(rng.uniform(0.4, 1.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
    assert kills >= 3
    # Plant crash debris: a stray temp file and a committed shard truncated (no footer).
    (work / "out/.part-00001.parquet.tmp-999-dead").write_bytes(b"partial")
    committed = sorted((work / "out").glob("part-*.parquet"))
    if committed:
        victim = committed[0]
        victim.write_bytes(victim.read_bytes()[:40])
    final = start(job, work, delay=0.0)
    assert final.wait(timeout=60) == 0, final.stderr.read().decode()
    check_complete(work / "out", data, expected)


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
    manifest = tmp_path / "out/_manifest"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (manifest.exists() and any(manifest.iterdir())):
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "out/_SUCCESS").exists()
    assert b"SIGTERM" in proc.stderr.read()
    again = start(job, tmp_path, delay=0.0)
    assert again.wait(timeout=60) == 0
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in data]
