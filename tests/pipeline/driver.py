"""Subprocess driver: run a job with a slowed FakeEngine (for kill / SIGTERM tests).

Usage: python driver.py JOB_FILE STEP_DELAY
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine, FakeTokenizer  # noqa: E402

from batchgen.job import load_job  # noqa: E402
from batchgen.pipeline.runner import Runner  # noqa: E402

if __name__ == "__main__":
    job = load_job(sys.argv[1])
    delay = float(sys.argv[2])
    runner = Runner(
        job,
        engine_factory=lambda j: FakeEngine(step_delay=delay, max_num_seqs=8),
        tokenizer_factory=lambda j: FakeTokenizer(),
        grace_s=float(os.environ.get("GRACE_S", "20")),
    )
    sys.exit(runner.run().exit_code)
