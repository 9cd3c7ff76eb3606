"""Engine and tokenizer factories for data parallel workers (module-level: a spawned worker
imports them by name), built on the fake engine."""

from __future__ import annotations

import os
import signal

from fake_engine import FakeEngine, FakeTokenizer

from batchgen.job import JobError

# The shard `failing_engine` cannot run: shard 0, the first a worker takes, so the worker that
# fails on it holds no other shard (a later shard could be taken while the one before it is
# finishing, and a failure charges every shard its worker held).
POISON_SHARD = 0


def tokenizer(job) -> FakeTokenizer:
    return FakeTokenizer()


def engine(job) -> FakeEngine:
    return FakeEngine(step_delay=0.01, max_num_seqs=8)


class FailingEngine(FakeEngine):
    """Fails on POISON_SHARD's first request: the first time by SIGKILL (a crash), every later
    time by raising as a CUDA error would. `marker` records that the crash happened."""

    def __init__(self, marker: str):
        super().__init__(step_delay=0.01, max_num_seqs=8)
        self.marker = marker

    def add_request(self, request_id, prompt, params) -> None:
        if request_id.startswith(f"{POISON_SHARD}/"):
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                raise RuntimeError("CUDA error: an illegal memory access was encountered") from None
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        super().add_request(request_id, prompt, params)


def failing_engine(job) -> FailingEngine:
    return FailingEngine(os.path.join(os.path.dirname(os.path.abspath(job.output.path)), "crashed"))


def broken_engine(job) -> FakeEngine:
    raise JobError("model: model.safetensors: cannot read the weights")
