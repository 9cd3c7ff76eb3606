"""Subprocess driver for overlapping runs: run job files in turn with a slowed FakeEngine.

Usage: python overlap_driver.py NAME STEP_DELAY JOB_FILE [JOB_FILE ...]
With SYNC_DIR and PEERS (names, comma-separated) set, run i starts only once every peer is
ready for its run i (files SYNC_DIR/NAME-i), so runs of several drivers start together.
LEASE_S sets the runs' lock lease.
Prints "RESULT i exit=CODE" or "RESULT i refused: MESSAGE" per job file; the run's own log
goes to stderr.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine, FakeTokenizer  # noqa: E402

from batchgen.job import JobError, load_job  # noqa: E402
from batchgen.pipeline.runner import Runner  # noqa: E402


def wait_for_peers(name: str, i: int) -> None:
    sync = os.environ.get("SYNC_DIR")
    if not sync:
        return
    open(os.path.join(sync, f"{name}-{i}"), "w").close()
    peers = os.environ["PEERS"].split(",")
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(sync, f"{p}-{i}")) for p in peers):
        if time.monotonic() > deadline:
            raise SystemExit(f"peers not ready for run {i}")
        time.sleep(0.001)


if __name__ == "__main__":
    name, delay = sys.argv[1], float(sys.argv[2])
    for i, job_file in enumerate(sys.argv[3:]):
        job = load_job(job_file)
        wait_for_peers(name, i)
        runner = Runner(
            job,
            engine_factory=lambda j: FakeEngine(step_delay=delay, max_num_seqs=8),
            tokenizer_factory=lambda j: FakeTokenizer(),
            log=lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True),
            lease_s=float(os.environ.get("LEASE_S", "120")),
        )
        try:
            code = runner.run().exit_code
            print(f"RESULT {i} exit={code}", flush=True)
        except JobError as e:
            print(f"RESULT {i} refused: {e}", flush=True)
