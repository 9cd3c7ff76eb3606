"""Dry run for `batchgen validate`: read, render and tokenize every row, no model weights."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.engine.request_checks import ModelLimits
from batchgen.io.readers import file_format, resolve_inputs
from batchgen.job import JobError, JobSpec
from batchgen.pipeline import engine_factory as factory
from batchgen.pipeline.job_limits import check_job_limits
from batchgen.pipeline.model_source import resolve_job_model
from batchgen.pipeline.modes import mode_for
from batchgen.plan.prompts import PromptError, PromptRenderer, TemplateLimits


@dataclass
class ValidateReport:
    files: list[str]
    rows: int = 0
    ok: int = 0
    errors: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # first few error messages
    # Per row (score mode: per candidate, prompt + candidate), compact.
    prompt_lengths: array = field(default_factory=lambda: array("q"))
    max_output_tokens: int = 0  # sum over ok rows of n x max_tokens (an upper bound)
    score: bool = False  # score mode: ok / errors count candidates, rows count input units

    def lines(self) -> list[str]:
        out = [
            f"input: {len(self.files)} file(s), {self.rows} rows: {self.ok} "
            f"{'candidates ' if self.score else ''}ok, {sum(self.errors.values())} will fail"
        ]
        for code, count in sorted(self.errors.items()):
            out.append(f"  {code}: {count}")
        out += [f"  e.g. {msg}" for msg in self.examples]
        if self.prompt_lengths:
            lens = sorted(self.prompt_lengths)
            pct = lambda q: lens[min(len(lens) - 1, int(q * len(lens)))]  # noqa: E731
            out.append(
                f"prompt tokens: min {lens[0]}, median {pct(0.5)}, p99 {pct(0.99)}, "
                f"max {lens[-1]}, total {sum(lens)}"
            )
            out.append(
                f"estimated tokens: {sum(lens)} prompt + up to {self.max_output_tokens} "
                f"generated = {sum(lens) + self.max_output_tokens}"
            )
        return out


def validate(
    job: JobSpec,
    tokenizer_factory: Callable[[JobSpec], factory.TokenizerLike] | None = None,
    limits_fn: Callable[[JobSpec], ModelLimits] | None = None,
    max_examples: int = 10,
    template_limits: TemplateLimits | None = None,
) -> ValidateReport:
    """Check the job against its input and model files; raises JobError for a bad job.

    Rows go through the run's own planner, which applies the engine's request checks
    (request_checks.py) against config.json's limits: a row counted ok here is one the
    engine accepts, and a failing row has the code and message the run would give it.
    """
    job = resolve_job_model(job)  # as the run does: a hub id becomes its snapshot directory
    files = resolve_inputs(job.input.path)
    mode = mode_for(job)
    columns = mode.columns(files, [file_format(f, job.input.format) for f in files])
    tok = (tokenizer_factory or factory.build_tokenizer)(job)
    # Chat templates render in a worker process under hard limits (template_process.py).
    renderer = PromptRenderer(
        job.prompt, tok.chat_template, tok.bos_token, tok.eos_token, limits=template_limits
    )
    with renderer:
        try:
            renderer.check(needs_chat=job.prompt.chat is not None)
        except PromptError as e:
            raise JobError(f"prompt: {e}") from None
        limits = (limits_fn or factory.model_limits)(job)
        check_job_limits(job, limits)
        planner = mode.planner(renderer, tok, limits, factory.structured_check(tok, limits))
        return _check_rows(job, files, mode.reader(files, columns), planner, max_examples)


def _check_rows(job: JobSpec, files: list[str], reader, planner, max_examples: int):
    """Every row through the planner: the report's counts, lengths and first errors."""
    report = ValidateReport(files, score=job.mode == "score")
    for chunk in reader:
        plan = planner.plan(chunk)
        report.rows += len(chunk)
        errors = list(plan.errors)
        for req in plan.requests:
            if job.mode == "score":
                errors += req.errors
                report.ok += len(req.token_ids)
                n = len(req.prompt_token_ids)
                report.prompt_lengths.extend(n + len(ids) for ids in req.token_ids.values())
            else:
                report.ok += 1
                report.prompt_lengths.append(len(req.prompt_token_ids))
                report.max_output_tokens += req.params.n * req.params.max_tokens
        for err in errors:
            report.errors[err.error_code] += 1
            if len(report.examples) < max_examples:
                report.examples.append(f"[{err.error_code}] {err.error}")
    return report
