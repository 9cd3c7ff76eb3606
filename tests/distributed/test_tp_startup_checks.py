"""Tensor parallel on CPU (gloo, two processes): ranks whose capture plans differ fail at
start-up with a clear error instead of waiting on each other; mixed steps (prompt chunks in
decode steps, eager) equal one rank's tokens, and the step log (BATCHGEN_TP_TRACE=1) shows both
ranks running the same steps in the same order."""

from __future__ import annotations

import random
import re
import time

import pytest

from batchgen import LLM, SamplingParams
from batchgen.distributed.group import TensorParallelError
from batchgen.engine import model_runner

OPTIONS = dict(
    dtype="float32",
    max_model_len=128,
    num_kv_blocks=128,
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
)


def test_ranks_with_different_plans_fail_at_start_up(tiny_model_dir, monkeypatch):
    """Rank 0 alone believes in a one-shot threshold (the workers run the real selection):
    the plans differ, and every rank raises before any graph or step."""
    real = model_runner.select_one_shot

    def skewed(tp, agree, *args):
        out = real(tp, agree, *args)
        tp.one_shot_max_bytes = 4096  # rank 0's process only: the workers are fresh
        return out

    monkeypatch.setattr(model_runner, "select_one_shot", skewed)
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as raised:
        LLM(tiny_model_dir("llama"), tensor_parallel_size=2, **OPTIONS)
    assert "planned different CUDA graphs" in str(raised.value)
    assert "rank 1 one_shot_max_bytes: 4096 against 0" in str(raised.value)
    assert time.monotonic() - start < 120  # no collective or store timeout was waited for


def step_lines(text: str, rank: int) -> list[str]:
    return re.findall(rf"^\[tp rank {rank}\] (step \d+: .*)$", text, flags=re.M)


def test_mixed_steps_equal_one_rank(tiny_model_dir, monkeypatch, capfd):
    path = tiny_model_dir("qwen3")  # q/k-norm, tied embeddings
    rng = random.Random(4)
    prompts = [[0] + [rng.randrange(5, 500) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=7)
    options = dict(OPTIONS, mixed_chunk_tokens=8)
    single = LLM(path, **options)
    want = single.generate(prompts, [greedy, sampled] * 3, use_tqdm=False)
    monkeypatch.setenv("BATCHGEN_TP_TRACE", "1")
    with LLM(path, tensor_parallel_size=2, **options) as parallel:
        assert parallel.engine.runner.mixed_chunk_tokens == 8
        got = parallel.generate(prompts, [greedy, sampled] * 3, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    log = capfd.readouterr().err
    rank0, rank1 = step_lines(log, 0), step_lines(log, 1)
    assert rank0 and rank0 == rank1  # the same steps, shapes and kinds, in the same order
    mixed = [s for s in rank0 if re.search(r"eager .* decode=[1-9]\d* chunks=[1-9]", s)]
    assert mixed, "no step carried decode rows and prompt chunks together"
    for rank in (0, 1):
        assert f"[tp rank {rank}] capture plan " in log and f"[tp rank {rank}] ready" in log
