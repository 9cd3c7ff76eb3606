"""Overlapping runs on one output directory: the same job shares the shards (each written
once), two different jobs never both proceed, and a run that starts while another writes
never breaks it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from workspace import make_job, read_output, rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("overlap_driver.py")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def start(cwd: Path, name: str, delay: float, *jobs: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(DRIVER), name, str(delay), *map(str, jobs)],
        cwd=cwd,
        env={**ENV, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return [line for line in out.splitlines() if line.startswith("RESULT")], err


def committed_by(log: str) -> set[int]:
    return {int(k) for k in re.findall(r"shard (\d+): committed", log)}


def test_two_runs_of_the_same_job_share_its_shards(tmp_path):
    data = rows(400)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 20})
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {"SYNC_DIR": str(sync), "PEERS": "a,b"}
    a, b = (start(tmp_path, name, 0.01, job, **env) for name in "ab")
    (res_a, log_a), (res_b, log_b) = finish(a), finish(b)
    assert res_a == res_b == ["RESULT 0 exit=0"], (log_a, log_b)
    done_a, done_b = committed_by(log_a), committed_by(log_b)
    assert not done_a & done_b  # no shard written twice
    assert done_a | done_b == set(range(20))
    assert done_a and done_b, "both runs worked"  # each skipped what the other held
    assert "is being written by" in log_a + log_b
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in data]
    assert (tmp_path / "out/_SUCCESS").exists()
    assert not (tmp_path / "out/_locks").exists() and not (tmp_path / "out/_partial").exists()


def test_two_different_jobs_on_a_new_dir_exactly_one_proceeds(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    rounds = 20
    jobs = {}
    for name, max_tokens in (("a", 8), ("b", 4)):
        jobs[name] = []
        for i in range(rounds):
            path = make_job(tmp_path, "in.jsonl", name=f"{name}{i}.yaml")
            spec = yaml.safe_load(path.read_text())
            spec["sampling"]["max_tokens"] = max_tokens  # a different job
            spec["output"]["path"] = f"out{i}"
            path.write_text(yaml.safe_dump(spec))
            jobs[name].append(path)
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {"SYNC_DIR": str(sync), "PEERS": "a,b"}
    procs = {name: start(tmp_path, name, 0.0, *jobs[name], **env) for name in "ab"}
    results = {name: finish(p)[0] for name, p in procs.items()}
    for i in range(rounds):
        got = {name: results[name][i] for name in "ab"}
        ok = [name for name, line in got.items() if line == f"RESULT {i} exit=0"]
        assert len(ok) == 1, got
        loser = got["b" if ok == ["a"] else "a"]
        # Refused while the winner runs, or after it committed: either way by name.
        assert re.match(
            rf"RESULT {i} refused: output.path: 'out{i}' (is being written by a run of a "
            rf"different job|holds results of a different job) \(changed: sampling",
            loser,
        ), loser
        out = tmp_path / f"out{i}"
        want = 8 if ok == ["a"] else 4
        assert read_output(out)["text"].str.len_chars().max() == want


def test_a_run_started_while_another_writes_never_breaks_it(tmp_path):
    data = rows(400)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 20})
    other = make_job(tmp_path, "in.jsonl", name="other.yaml", sampling={"max_tokens": 3})
    first = start(tmp_path, "a", 0.02, job)
    manifest = tmp_path / "out/_manifest"
    deadline = time.monotonic() + 60
    while not (manifest.is_dir() and len(os.listdir(manifest)) >= 2):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.01)
    # While the first run writes, a different job is refused and a second run of the same job
    # joins in (it must not touch the first run's files in progress).
    refused, _ = finish(start(tmp_path, "b", 0.0, other))
    assert re.match(r"RESULT 0 refused: .*being written by a run of a different job", refused[0])
    second = start(tmp_path, "c", 0.02, job)
    (res_a, log_a), (res_c, log_c) = finish(first), finish(second)
    assert res_a == res_c == ["RESULT 0 exit=0"], (log_a, log_c)
    assert not committed_by(log_a) & committed_by(log_c)
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in data]


def test_status_shows_shards_in_progress_and_locks_of_dead_runs(tmp_path):
    from click.testing import CliRunner

    from batchgen.cli import main

    write_jsonl(tmp_path / "in.jsonl", rows(400))
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 20})
    proc = start(tmp_path, "a", 0.05, job)
    out = tmp_path / "out"
    deadline = time.monotonic() + 60
    while not (out / "_manifest").is_dir():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    shown = CliRunner().invoke(main, ["status", str(out)]).output
    assert "in progress" in shown
    held = re.search(r"  part-(\d{5}): (\S+) pid (\d+), task 0/1, since", shown)
    assert held and int(held.group(3)) == proc.pid, shown
    assert f"runs: {held.group(2)} pid {proc.pid}, task 0/1" in shown
    proc.kill()  # its locks stay behind, their holder gone
    proc.wait()
    shown = CliRunner().invoke(main, ["status", str(out)]).output
    assert f"stale locks (holder gone; the next run takes them over): part-{held.group(1)}" in (
        shown
    )


def test_a_paused_holder_whose_lease_lapsed_cannot_commit_a_second_copy(tmp_path):
    # A is frozen mid-run past its lease: B takes its shards over and finishes the job. When A
    # wakes up, its commit of the shard it was working on finds B's file: A keeps it, and no
    # shard is written twice.
    data = rows(300)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = make_job(tmp_path, "in.jsonl", output={"shard_rows": 20})
    a = start(tmp_path, "a", 0.05, job, LEASE_S="2")
    manifest = tmp_path / "out/_manifest"
    deadline = time.monotonic() + 60
    while not (manifest.is_dir() and len(os.listdir(manifest)) >= 2):
        assert time.monotonic() < deadline and a.poll() is None
        time.sleep(0.01)
    a.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # past A's 2 s lease: its locks are stale though its process lives
        res_b, log_b = finish(start(tmp_path, "b", 0.0, job, LEASE_S="2"))
        assert res_b == ["RESULT 0 exit=0"], log_b
    finally:
        a.send_signal(signal.SIGCONT)
    res_a, log_a = finish(a)
    assert res_a == ["RESULT 0 exit=0"], log_a
    assert "committed by another process meanwhile; keeping its file" in log_a
    done_a, done_b = committed_by(log_a), committed_by(log_b)
    assert not done_a & done_b and done_a | done_b == set(range(15))
    assert read_output(tmp_path / "out")["id"].to_list() == [r["id"] for r in data]
