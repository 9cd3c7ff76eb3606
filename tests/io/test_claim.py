"""Claiming an output directory: one job per directory, even for runs started together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from batchgen.io import locks, manifest
from batchgen.io.claim import claim_output
from batchgen.job import JobError


def record(fp: str, model: str = "m1") -> dict:
    return {"fingerprint": fp, "parts": {"model": model, "input": "i"}}


def test_new_dir_then_same_job_again(tmp_path):
    out = str(tmp_path / "out")
    first = claim_output(out, record("A"), overwrite=False)
    second = claim_output(out, record("A"), overwrite=False)  # same job: both proceed
    assert manifest.read_job(out)["fingerprint"] == "A"
    assert first.still_ours() and second.still_ours() and first.path != second.path
    first.release()
    second.release()


def test_different_job_refused_while_a_run_is_live(tmp_path):
    out = str(tmp_path / "out")
    run = claim_output(out, record("A"), overwrite=False)
    with pytest.raises(JobError, match=r"being written by a run of a different job \(changed: "):
        claim_output(out, record("B", "m2"), overwrite=True)
    run.release()


def test_failed_first_run_does_not_block_the_fixed_one(tmp_path):
    # The first run claimed the directory, then failed (say, at model load): nothing is
    # committed and its process is gone, so the rerun with the fixed model takes the claim.
    out = str(tmp_path / "out")
    claim_output(out, record("A"), overwrite=False).release()
    logs = []
    run = claim_output(out, record("B", "m2"), overwrite=False, log=logs.append)
    assert manifest.read_job(out)["fingerprint"] == "B"
    assert "committed nothing" in logs[0] and "changed: model" in logs[0]
    run.release()


def test_committed_results_need_overwrite(tmp_path):
    out = str(tmp_path / "out")
    claim_output(out, record("A"), overwrite=False).release()
    (tmp_path / "out" / "part-00000.parquet").write_bytes(b"x")
    with pytest.raises(JobError, match=r"holds results of a different job .*--overwrite"):
        claim_output(out, record("B", "m2"), overwrite=False)
    claim_output(out, record("B", "m2"), overwrite=True).release()
    assert not (tmp_path / "out" / "part-00000.parquet").exists()
    assert manifest.read_job(out)["fingerprint"] == "B"


def test_a_killed_runs_lock_does_not_block(tmp_path):
    out = str(tmp_path / "out")
    claim_output(out, record("A"), overwrite=False)  # never released: as if SIGKILLed...
    path = locks.lock_path(out, "run-x.lock")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)  # fmt: skip
    with open(path, "w") as f:  # ...in another process, now gone
        json.dump({"host": locks.HOST, "boot_id": locks.BOOT_ID, "pid": int(ended.stdout)}, f)
    for name in os.listdir(os.path.dirname(path)):
        if name.startswith("run-") and name != "run-x.lock":
            os.unlink(os.path.join(os.path.dirname(path), name))
    claim_output(out, record("B", "m2"), overwrite=False).release()
    assert manifest.read_job(out)["fingerprint"] == "B"


def test_two_jobs_racing_on_a_new_dir_exactly_one_wins(tmp_path):
    for i in range(20):
        out = str(tmp_path / f"out{i}")
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}

        def go(fp, out=out, barrier=barrier, results=results):
            barrier.wait()
            try:
                results[fp] = claim_output(out, record(fp, fp), overwrite=False)
            except JobError as e:
                results[fp] = e

        threads = [threading.Thread(target=go, args=(fp,)) for fp in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [fp for fp, r in results.items() if isinstance(r, locks.HeldLock)]
        assert len(won) == 1, results
        assert manifest.read_job(out)["fingerprint"] == won[0]
        lost = results["B" if won == ["A"] else "A"]
        assert "being written by a run of a different job" in str(lost)
        results[won[0]].release()
