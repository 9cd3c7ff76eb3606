"""Tensor-parallel start-up errors come before any worker starts or weight loads; a worker that
dies makes the engine raise a clear error instead of hanging; shutdown ends the workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchgen import LLM, SamplingParams
from batchgen.config import ConfigError, EngineConfig
from batchgen.distributed.group import TensorParallelError
from batchgen.job import JobError
from batchgen.job.load import validate_job
from batchgen.pipeline.engine_factory import model_limits

OPTIONS = dict(dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=8)


def test_size_that_does_not_split_the_heads_fails_before_any_process(tiny_model_dir):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide .*heads=4"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=3, **OPTIONS)
    assert time.monotonic() - start < 5  # no worker was started (one takes seconds)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=0: must be >= 1"):
        EngineConfig(model="m", tensor_parallel_size=0)


def test_job_key_and_its_check_before_weights(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1, "text": "a"}\n')
    raw = {
        "model": {"path": path, "tensor_parallel_size": 2},
        "input": {"path": str(data)},
        "prompt": {"template": "{text}"},
        "output": {"path": str(tmp_path / "out")},
    }
    job = validate_job(raw)
    assert job.model.engine_config().tensor_parallel_size == 2
    model_limits(job)  # 2 splits the tiny model
    raw["model"]["tensor_parallel_size"] = 8
    with pytest.raises(JobError, match=r"model\.tensor_parallel_size=8 does not divide"):
        model_limits(validate_job(raw))
    raw["model"]["tensor_parallel_size"] = "two"
    with pytest.raises(JobError, match=r"model\.tensor_parallel_size"):
        validate_job(raw)


def test_process_group_that_cannot_start_is_a_clear_error(tiny_model_dir, monkeypatch):
    # gloo cannot bind a device that does not exist: every rank's init fails.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "batchgen-no-such-nic0")
    with pytest.raises(ConfigError, match=r"could not start the gloo process group"):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=2, **OPTIONS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_dead_worker_fails_the_run_with_its_rank(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2, **OPTIONS)
    worker = llm.engine.runner.peers.procs[1]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i in range(4):
        engine.add_request(str(i), [0, 5 + i, 9, 11], params)
    for _ in range(3):  # the run is under way
        engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    died = r"rank 1 \(pid \d+\) died \(killed by signal 9\)"
    with pytest.raises(TensorParallelError, match=died):
        while time.monotonic() < deadline:
            engine.step()
    llm.shutdown()  # returns although a rank is gone


def test_shutdown_ends_the_workers(tiny_model_dir):
    llm = LLM(tiny_model_dir("qwen3"), tensor_parallel_size=2, **OPTIONS)
    out = llm.generate([[0, 5, 6]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    pid = llm.engine.runner.peers.procs[1].pid
    llm.shutdown()
    assert not _alive(pid)
    llm.shutdown()  # twice is fine
