"""Data parallel runs with fake engines (no model): a shard whose workers fail twice (once
killed, once raising as a CUDA error would) is set aside while the other shards finish, the
run exits 70 naming it, and a rerun completes it with every row exactly once; workers of a
`--shard` task run that task's shards only; workers that cannot load the model end the run
with their error (exit 2)."""

from __future__ import annotations

import os
import re

import dp_fakes
import pytest
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.io import locks, manifest
from batchgen.pipeline.data_parallel import run_task
from batchgen.pipeline.exit_codes import EX_SOFTWARE, EXIT_BAD_JOB
from batchgen.pipeline.sharding import ShardSelector

pytestmark = pytest.mark.skipif(not hasattr(os, "setpgrp"), reason="POSIX process groups")

ROWS, SHARD_ROWS = 400, 50


def dp_job(tmp_path, monkeypatch, size: int):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", rows(ROWS))
    model = {"path": "model", "max_num_seqs": 8, "data_parallel_size": size, "device": "cpu"}
    return load(make_job(tmp_path, "in.jsonl", model=model, output={"shard_rows": SHARD_ROWS}))


def test_shard_failing_twice_is_set_aside_then_resumed(tmp_path, monkeypatch):
    job = dp_job(tmp_path, monkeypatch, 3)
    data = rows(ROWS)
    lines: list[str] = []
    result = run_task(
        job,
        engine_factory=dp_fakes.failing_engine,
        tokenizer_factory=dp_fakes.tokenizer,
        log=lines.append,
        checkpoint_s=None,
    )
    log = "\n".join(lines + result.lines)
    poison = dp_fakes.POISON_SHARD
    assert result.exit_code == EX_SOFTWARE, log
    assert not result.complete
    assert f"shard(s) {poison} failed twice" in log
    killed = r"^data parallel: worker \d \(cpu, pid \d+\) was killed by SIGKILL while holding"
    assert re.search(rf"{killed} shard\(s\) {poison}$", log, flags=re.M), log
    assert "CUDA error: an illegal memory access" in log
    assert f"shard {poison} goes back to the queue" in log
    assert f"shard {poison} failed twice; it is set aside" in log
    committed = manifest.committed_shards("out", _fingerprint())
    assert sorted(committed) == [k for k in range(ROWS // SHARD_ROWS) if k != poison], log
    assert locks.list_locks("out") == []  # the set-aside lock went with the run
    # A rerun (the engine fixed) does the set-aside shard only.
    again = run_task(job, engine_factory=dp_fakes.engine, tokenizer_factory=dp_fakes.tokenizer)
    assert again.exit_code == 0 and again.complete, again.lines
    assert again.stats.shards_committed == 1
    out = read_output("out")
    assert out["id"].to_list() == [r["id"] for r in data]
    assert out["error"].null_count() == ROWS


def test_workers_of_a_shard_task_run_its_shards_only(tmp_path, monkeypatch):
    job = dp_job(tmp_path, monkeypatch, 2)
    fakes = dict(engine_factory=dp_fakes.engine, tokenizer_factory=dp_fakes.tokenizer)
    lines: list[str] = []
    odd = run_task(job, shard=ShardSelector(1, 2), log=lines.append, **fakes)
    assert odd.exit_code == 0 and not odd.complete, lines
    assert sorted(manifest.committed_shards("out", _fingerprint())) == [1, 3, 5, 7]
    assert f"rows of task 1/2: {ROWS // 2} ok, 0 error(s)" in odd.lines
    assert sum(line.startswith("[worker ") and "committed" in line for line in lines) == 4
    even = run_task(job, shard=ShardSelector(0, 2), **fakes)
    assert even.exit_code == 0 and even.complete
    assert read_output("out")["id"].to_list() == [r["id"] for r in rows(ROWS)]


def test_workers_that_cannot_load_the_model_end_the_run_with_their_error(tmp_path, monkeypatch):
    job = dp_job(tmp_path, monkeypatch, 2)
    result = run_task(
        job, engine_factory=dp_fakes.broken_engine, tokenizer_factory=dp_fakes.tokenizer
    )
    assert result.exit_code == EXIT_BAD_JOB
    # Both workers failed: on two shards, or (the second taking the first's) twice on one.
    last = result.lines[-1]
    assert "no engine worker is left" in last or "shard(s) 0 failed twice" in last, last
    assert "model.safetensors: cannot read the weights" in result.lines[-1]
    assert manifest.committed_shards("out", _fingerprint()) == {}


def _fingerprint() -> str:
    return manifest.read_job("out")["fingerprint"]
