"""Capture plans and collective records are compared across tensor-parallel ranks before and
after capture: equal plans pass, a difference fails every rank with a message naming the rank
and field, over a real control connection and without waiting for anything."""

from __future__ import annotations

import dataclasses
import threading
import time
from multiprocessing import Pipe

import pytest

from batchgen.distributed.group import TensorParallelError
from batchgen.distributed.workers import Rank0Link, WorkerPool
from batchgen.engine.capture_plan import (
    CapturePlan,
    collectives_mismatch,
    collectives_summary,
    plan_graphs,
    plan_mismatch,
    settle_collectives,
    settle_plan,
)


def route(nbytes: int) -> str:
    return "one-shot" if nbytes <= 4096 else "nccl"


def make_plan(**changes) -> CapturePlan:
    row_bytes = 64 * 4
    plan = CapturePlan(
        graphs=plan_graphs([1, 2, 4], [1, 2], 8, lambda rows: route(rows * row_bytes)),
        hidden_size=64,
        dtype="torch.float32",
        num_kv_blocks=100,
        block_size=16,
        max_model_len=512,
        chunk_tokens=8,
        one_shot_max_bytes=4096,
    )
    return dataclasses.replace(plan, **changes)


def test_graphs_in_capture_order_with_their_routes():
    assert make_plan().graphs == (
        ("decode", 4, 4, "one-shot"),
        ("decode", 2, 2, "one-shot"),
        ("decode", 1, 1, "one-shot"),
        ("mixed", 2, 10, "one-shot"),
        ("mixed", 1, 9, "one-shot"),
    )
    # Each graph's route follows its rows: 16 rows of 1 KB past the one-shot limit, 2 within.
    assert plan_graphs([2, 16], [], 0, lambda rows: route(rows * 1024)) == (
        ("decode", 16, 16, "nccl"),
        ("decode", 2, 2, "one-shot"),
    )


def test_equal_plans_pass_and_differences_are_named():
    assert plan_mismatch([make_plan(), make_plan(), make_plan()]) is None
    fewer = make_plan(graphs=make_plan().graphs[1:])
    message = plan_mismatch([make_plan(), make_plan(num_kv_blocks=90), fewer])
    assert "planned different CUDA graphs" in message
    assert "rank 1 num_kv_blocks: 100 against 90" in message
    assert "rank 2 graphs: item 0: ('decode', 4, 4, 'one-shot') against ('decode', 2," in message
    assert make_plan().digest() == make_plan().digest() != fewer.digest()


def test_collective_records_compared_by_sequence():
    a = [("all_reduce", "one-shot", 256), ("all_reduce", "nccl", 8192)]
    b = [("all_reduce", "nccl", 256), ("all_reduce", "nccl", 8192)]
    same = collectives_summary(a)
    assert same[0] == 2 and same[2] == {"all_reduce/one-shot": 1, "all_reduce/nccl": 1}
    assert collectives_mismatch([same, collectives_summary(list(a))]) is None
    message = collectives_mismatch([same, collectives_summary(b)])
    assert "rank 1: 2 {'all_reduce/nccl': 2}" in message


def test_mismatch_fails_rank_0_and_the_worker_over_the_control_connection():
    """Rank 0 (a WorkerPool) and rank 1 (a Rank0Link on a thread) settle different plans: both
    raise TensorParallelError at once; neither waits for the other."""
    near, far = Pipe()
    pool = WorkerPool({}, {1: near})
    worker_error: list[BaseException] = []

    def rank1() -> None:
        try:
            settle_plan(Rank0Link(1, far).agree, make_plan(chunk_tokens=16))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            worker_error.append(e)

    thread = threading.Thread(target=rank1, daemon=True)
    start = time.monotonic()
    thread.start()
    with pytest.raises(TensorParallelError, match=r"rank 1 chunk_tokens: 8 against 16"):
        settle_plan(pool.agree, make_plan())
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - start < 30
    assert isinstance(worker_error[0], TensorParallelError)
    assert "rank 1 chunk_tokens: 8 against 16" in str(worker_error[0])
    # The next phase still runs in step: equal records pass on both sides.
    record = [("all_reduce", "gloo", 256)]
    thread = threading.Thread(
        target=settle_collectives, args=(Rank0Link(1, far).agree, record), daemon=True
    )
    thread.start()
    settle_collectives(pool.agree, list(record))
    thread.join(timeout=30)
    assert not thread.is_alive()
    pool.close(timeout_s=1)
