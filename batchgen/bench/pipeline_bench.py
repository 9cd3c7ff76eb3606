"""The `pipeline` workload: `batchgen run` end to end vs the engine alone on the same requests.

The rows are an OpenAI-batch JSONL file (`/v1/completions` with token-id prompts and per-row
max_tokens), the one input format that carries token ids, so a random-weight preset without a
tokenizer runs the whole pipeline: reader, planner (validation, prefix grouping, length sort),
engine, Parquet shard writer and manifest. The job goes through the pipeline's public entry
point, `batchgen.pipeline.runner.Runner`, with its engine factory handing over a fresh engine on
the already-loaded model (so model load is outside both timings).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from batchgen.bench.engine_run import Bench
from batchgen.bench.timing import timed
from batchgen.bench.workloads import Workload


class PipelineUnavailable(RuntimeError):
    """The pipeline runner is missing or changed shape; the message says what."""


@dataclass
class _NoTokenizer:
    """Token-id prompts never reach a tokenizer; the prompt renderer only reads these."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        raise PipelineUnavailable("the pipeline benchmark sends token ids only")


def write_rows(w: Workload, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, (prompt, m) in enumerate(zip(w.prompts, w.max_tokens)):
            body = {"prompt": prompt, "max_tokens": m, "temperature": w.temperature, "seed": i}
            line = {"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def run_pipeline(bench: Bench, w: Workload, shard_rows: int = 10000) -> dict[str, Any]:
    """Time `Runner(job).run()` over `w` written as JSONL rows (writing them is not timed)."""
    try:
        from batchgen.job import validate_job
        from batchgen.pipeline.runner import Runner
    except ImportError as e:
        raise PipelineUnavailable(f"the pipeline runner is not importable: {e}") from e
    engines = []

    def engine_factory(job):
        engines.append(bench.engine())
        return engines[-1]

    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp:
        rows, model_dir = os.path.join(tmp, "rows.jsonl"), os.path.join(tmp, "model")
        os.makedirs(model_dir)  # the runner checks model.path is a dir; nothing is read from it
        write_rows(w, rows)
        job = validate_job(
            {
                "model": {"path": model_dir, "dtype": bench.config.dtype},
                "input": {"path": rows, "format": "openai-batch"},
                "sampling": {"ignore_eos": True},
                "output": {"path": os.path.join(tmp, "out"), "shard_rows": shard_rows},
            },
            source="<bench pipeline job>",
        )
        runner = Runner(
            job,
            engine_factory=engine_factory,
            tokenizer_factory=lambda job: _NoTokenizer(),
            log=lambda message: None,
        )
        wall, result = timed(runner.run, bench.device)
    stats = engines[0].stats if engines else None
    return {
        "wall_s": wall,
        "exit_code": result.exit_code,
        "rows_ok": result.totals.get("ok"),
        "rows_error": result.totals.get("errors"),
        "output_tokens": stats.num_generated_tokens if stats else 0,
        "prompt_tokens": stats.num_prompt_tokens if stats else 0,
        "cached_tokens": stats.num_cached_tokens if stats else 0,
        "preemptions": stats.num_preemptions if stats else 0,
        "steps": stats.num_steps if stats else 0,
        "complete": result.complete,
    }
