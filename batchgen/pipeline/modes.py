"""Job modes: the parts of a run that differ between generating text and scoring candidates.

The runner and `batchgen validate` own the flow (read, plan, feed the engine, commit shards);
a mode says which columns to read, how to read and plan units, how to submit a request, how an
engine output becomes output rows and how a shard's rows are checked and counted.
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.request_checks import ModelLimits
from batchgen.io.readers import Reader, check_columns
from batchgen.io.rows import ResultRow
from batchgen.io.writer import ShardLayout
from batchgen.job import JobSpec, require_prompt
from batchgen.job.placeholders import placeholders
from batchgen.outputs import RequestOutput
from batchgen.plan.planner import Planner, Request, to_result
from batchgen.plan.prompts import PromptRenderer


class GenerateMode:
    """mode: generate — one request (n samples) and one output row per input row."""

    def __init__(self, job: JobSpec):
        self.job = job
        self._token_bytes = None  # OpenAI-batch output: the tokenizer's, for log-probs

    def columns(self, files: list[str], formats: list[str]) -> list[str]:
        """The input columns the job reads; raises JobError if the input lacks them."""
        job = self.job
        require_prompt(job, formats)
        columns = placeholders(job.prompt) + list(job.input.columns)
        if job.sampling.overrides_column:
            columns.append(job.sampling.overrides_column)
        check_columns(files, job.input, columns)
        return columns

    def reader(self, files: list[str], columns: list[str], chunk_rows: int = 1024):
        return Reader(files, self.job.input, columns, chunk_rows)

    def layout(self, passthrough: tuple[tuple[str, Any], ...], model: str) -> ShardLayout:
        out = self.job.output
        multi = self.job.sampling.base_params().get("n", 1) > 1
        return ShardLayout(
            passthrough,
            multi,
            out.format,
            out.compression,
            model,
            structured=self.job.sampling.may_constrain,
            parse_json=out.parse_json,
        )

    def planner(
        self, renderer: PromptRenderer, tokenizer, limits: ModelLimits, structured_check=None
    ) -> Planner:
        """The job's planner; structured_check (constraint -> why refused, or None) compiles
        rows' structured_outputs (the engine's own compiler in a run)."""
        job = self.job
        if job.output.format == "openai-batch":
            self._token_bytes = getattr(tokenizer, "token_bytes", None)
        multi = job.sampling.base_params().get("n", 1) > 1 or job.output.format == "openai-batch"
        return Planner(
            renderer,
            tokenizer,
            limits,
            job.sampling.base_params(),
            job.input.columns,
            job.sampling.overrides_column,
            allow_multi=multi,
            structured_check=structured_check,
        )

    def submit(self, engine, request_id: str, req: Request) -> None:
        engine.add_request(request_id, req.prompt_token_ids, req.params)

    def results(self, req: Request, out: RequestOutput) -> list[ResultRow]:
        return [to_result(req, out, self._token_bytes)]

    def fingerprint_parts(self, parts: dict[str, str]) -> dict[str, str]:
        """The output's columns beyond the contract's: named only when present, so jobs
        without them keep their fingerprint, and an output begun before they existed is
        refused (its shards lack them) instead of mixed."""
        extra = {}
        if self.job.sampling.may_constrain and self.job.output.format == "parquet":
            extra["output.incomplete_column"] = "1"
        if self.job.output.parse_json:
            extra["output.parse_json"] = "1"
        return {**parts, **extra}

    def check(self, k: int, num_rows: int, results: list[ResultRow]) -> None:
        """Every row of shard k has exactly one result."""
        if len(results) != num_rows or len({r.index for r in results}) != num_rows:
            raise RuntimeError(f"shard {k}: {len(results)} results for {num_rows} rows")

    def totals(self, results: list[ResultRow]) -> dict[str, int]:
        """A shard's counters for its manifest entry."""

        def total(attr: str) -> int:
            vals = [getattr(r, attr) for r in results]
            return sum(sum(v) if isinstance(v, list) else v for v in vals)

        return dict(
            ok=sum(r.ok for r in results),
            errors=sum(not r.ok for r in results),
            num_prompt_tokens=total("num_prompt_tokens"),
            num_cached_tokens=total("num_cached_tokens"),
            num_generated_tokens=total("num_output_tokens"),
        )


def mode_for(job: JobSpec):
    """The mode object of a job (GenerateMode or ScoreMode)."""
    if job.mode == "score":
        from batchgen.pipeline.score_mode import ScoreMode

        return ScoreMode(job)
    return GenerateMode(job)
