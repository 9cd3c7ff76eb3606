"""mode: score — log-likelihood of each row's candidates; one output row per candidate."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from typing import Any

from batchgen.engine.request_checks import ModelLimits
from batchgen.io.readers import Reader, _sample_objects, check_columns
from batchgen.io.score_reader import GroupReader
from batchgen.io.score_rows import ScoreRow
from batchgen.io.writer import ShardLayout
from batchgen.job import JobError, JobSpec
from batchgen.job.placeholders import placeholders
from batchgen.job.spec import ScoreSpec
from batchgen.outputs import RequestOutput
from batchgen.plan.prompts import PromptRenderer
from batchgen.plan.score_planner import ScorePlanner, ScoreRequest, to_score_rows


class ScoreMode:
    """Units are input rows (list layout) or groups of rows (group layout); see job/score.py."""

    def __init__(self, job: JobSpec):
        assert job.score is not None
        self.job = job
        self.spec: ScoreSpec = job.score

    def columns(self, files: list[str], formats: list[str]) -> list[str]:
        """The input columns the job reads; raises JobError naming the score key it misses."""
        spec = self.spec
        for path, fmt in zip(files, formats):
            if fmt == "openai-batch":
                raise JobError(
                    f"input.path: {path} holds OpenAI batch lines; score mode reads parquet "
                    "or jsonl rows"
                )
            _check_score_columns(path, fmt, spec)
        own = [spec.candidates_column] if not spec.grouped else [spec.candidate_column]
        columns = placeholders(self.job.prompt) + list(self.job.input.columns) + own
        check_columns(files, self._input_spec(), columns)
        return list(dict.fromkeys(columns))

    def _input_spec(self):
        if self.spec.grouped:
            return replace(self.job.input, id_column=self.spec.group_column)
        return self.job.input

    def reader(self, files: list[str], columns: list[str], chunk_rows: int = 1024):
        if self.spec.grouped:
            return GroupReader(files, self.job.input, columns, self.spec.group_column, chunk_rows)
        return Reader(files, self.job.input, columns, chunk_rows)

    def layout(self, passthrough: tuple[tuple[str, Any], ...], model: str) -> ShardLayout:
        return ShardLayout(
            passthrough,
            compression=self.job.output.compression,
            model=model,
            mode="score",
            token_logprobs=self.spec.return_token_logprobs,
        )

    def planner(
        self, renderer: PromptRenderer, tokenizer, limits: ModelLimits, structured_check=None
    ) -> ScorePlanner:
        """The score planner (structured_check is unused: score mode generates nothing)."""
        return ScorePlanner(renderer, tokenizer, limits, self.spec, self.job.input.columns)

    def submit(self, engine, request_id: str, req: ScoreRequest) -> None:
        candidates = list(req.token_ids.values())
        engine.add_score_request(
            request_id, req.prompt_token_ids, candidates, self.spec.return_token_logprobs
        )

    def results(self, req: ScoreRequest, out: RequestOutput) -> list[ScoreRow]:
        return to_score_rows(req, out)

    def fingerprint_parts(self, parts: dict[str, str]) -> dict[str, str]:
        data = json.dumps(asdict(self.spec), sort_keys=True).encode()
        return {**parts, "score": hashlib.sha256(data).hexdigest()[:16]}

    def check(self, k: int, num_units: int, results: list[ScoreRow]) -> None:
        """Every unit of shard k has results, and no candidate appears twice."""
        keys = {(r.index, r.candidate_index) for r in results}
        if len({r.index for r in results}) != num_units or len(keys) != len(results):
            raise RuntimeError(f"shard {k}: {len(results)} score rows do not cover {num_units}")

    def totals(self, results: list[ScoreRow]) -> dict[str, int]:
        """A shard's counters; prompt tokens count once per unit (its candidates share them).

        `rows` is the number of rows in the shard file (what resume verifies), `units` the
        input rows or groups they came from.
        """
        prompts = {r.index: (r.num_prompt_tokens, r.num_cached_tokens) for r in results}
        return dict(
            rows=len(results),
            units=len(prompts),
            ok=sum(r.ok for r in results),
            errors=sum(not r.ok for r in results),
            num_prompt_tokens=sum(p for p, _ in prompts.values()),
            num_cached_tokens=sum(c for _, c in prompts.values()),
            num_generated_tokens=0,
            num_scored_tokens=sum(r.num_tokens or 0 for r in results),
        )


def _check_score_columns(path: str, fmt: str, spec: ScoreSpec) -> None:
    keys = (
        [("group_column", spec.group_column), ("candidate_column", spec.candidate_column)]
        if spec.grouped
        else [("candidates_column", spec.candidates_column)]
    )
    import polars as pl  # here, not at the top: importing the runner must not need polars

    if fmt == "parquet":
        try:
            schema = pl.read_parquet_schema(path)
        except Exception as e:
            raise JobError(f"input.path: {path} is not readable Parquet ({e})") from None
    else:
        schema = {}
        for obj in _sample_objects(path, 100):
            schema.update(obj)
        if not schema:
            return
    for key, column in keys:
        if column not in schema:
            raise JobError(
                f"score.{key}: column {column!r} is not in {path} (its columns: "
                f"{', '.join(sorted(schema))})"
            )
    if fmt == "parquet" and not spec.grouped:
        dtype = schema[spec.candidates_column]
        if not isinstance(dtype, (pl.List, pl.Array)):
            raise JobError(
                f"score.candidates_column: column {spec.candidates_column!r} in {path} is "
                f"{dtype}, expected a list of strings (or use score.group_column + "
                "score.candidate_column for one row per candidate)"
            )
