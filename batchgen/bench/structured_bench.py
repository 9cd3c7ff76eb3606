"""`batchgen bench --structured-schema`: the workload with a JSON schema on every request, then
the same requests unconstrained, each replaying its constrained output length (ignore_eos)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from batchgen.bench.engine_run import Bench, run_engine
from batchgen.bench.report import median_run, rates
from batchgen.bench.workloads import Workload
from batchgen.models.tiny_tokenizer import BOS, EOS
from batchgen.models.tokenizer import Tokenizer
from batchgen.models.wide_tokenizer import wide_bpe_tokenizer


def bench_tokenizer(bench: Bench, vocab_size: int) -> tuple[Tokenizer, str]:
    """The model directory's tokenizer, or for a random preset a byte-level BPE of the preset's
    vocabulary size (mask cost grows with the vocabulary and its token strings); and its name."""
    if bench.model_path is not None:
        return Tokenizer.from_dir(bench.model_path), f"{bench.model_path}/tokenizer.json"
    tok = Tokenizer(wide_bpe_tokenizer(vocab_size), {"bos_token": BOS, "eos_token": EOS})
    return tok, f"wide BPE, {vocab_size:,} tokens (batchgen.models.wide_tokenizer, seed 0)"


def load_schema(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_structured(
    bench: Bench,
    w: Workload,
    schema_path: str,
    repeat: int,
    warmup: int,
    result: Callable[[dict[str, Any], Workload], dict[str, Any]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Each of `repeat` rounds: the constrained run, then its replay (same prompts, seeds and
    temperature; max_tokens = each request's constrained output length; no constraint,
    ignore_eos). Ratio: median constrained output tok/s over median replay output tok/s.

    result(run, workload): the session's per-run summary (roofline etc.) of a median run.
    """
    vocab = bench.runner.model_config.vocab_size
    tokenizer, tokenizer_name = bench_tokenizer(bench, vocab)
    log(f"structured: tokenizer {tokenizer_name}")
    constraint = {"json": load_schema(schema_path)}
    constrained, replays = [], []
    finish: Counter = Counter()
    replay_w = w
    for i in range(repeat):
        log(f"structured: constrained run {i + 1}/{repeat} ...")
        outputs: dict[str, Any] = {}
        run = run_engine(
            bench,
            w,
            warmup,
            tokenizer=tokenizer,
            submit_kw={"ignore_eos": False, "structured_outputs": constraint},
            outputs=outputs,
        )
        lengths = [len(outputs[str(j)].token_ids) for j in range(w.num_requests)]
        finish = Counter(outputs[str(j)].finish_reason for j in range(w.num_requests))
        replay_w = replace(w, max_tokens=[max(1, n) for n in lengths])
        constrained.append(rates(run.as_dict(), replay_w))
        log(f"structured: replay run {i + 1}/{repeat} (unconstrained, ignore_eos) ...")
        replay = run_engine(bench, replay_w, warmup, tokenizer=tokenizer)
        replays.append(rates(replay.as_dict(), replay_w))
    c, r = median_run(constrained), median_run(replays)
    return {
        "schema": schema_path,
        "tokenizer": tokenizer_name,
        "finish_reasons": dict(finish),
        "output_tokens": replay_w.num_output_tokens,
        "runs": constrained,
        "result": result(c, replay_w),
        "replay": {
            "runs": replays,
            "result": result(r, replay_w),
            "max_tokens": replay_w.max_tokens,
        },
        "ratio": c["output_tok_s"] / r["output_tok_s"],
    }
