"""The `score:` job section: where each row's candidate continuations come from, and how."""

from __future__ import annotations

from batchgen.job.keys import get, section
from batchgen.job.spec import InputSpec, JobError, OutputSpec, PromptSpec, ScoreSpec

SCORE_KEYS = [
    "candidates_column",
    "group_column",
    "candidate_column",
    "separator",
    "return_token_logprobs",
]


def score_spec(
    raw: dict, mode: str, inp: InputSpec, prompt: PromptSpec, output: OutputSpec
) -> ScoreSpec | None:
    """Validate `score:` (and what score mode rules out elsewhere); None in generate mode."""
    if mode != "score":
        if raw.get("score") is not None:
            raise JobError(f"score: only used with mode: score (this job has mode: {mode})")
        return None
    sec = section(raw, "score", SCORE_KEYS, required=False)
    names = {}
    for key in ("candidates_column", "group_column", "candidate_column"):
        value = get(sec, "score", key, "str", None)
        if value is not None and not value:
            raise JobError(f"score.{key}: must not be empty")
        names[key] = value
    listed = names["candidates_column"] is not None
    grouped = names["group_column"] is not None or names["candidate_column"] is not None
    if listed == grouped:
        raise JobError(
            "score: give either score.candidates_column (a list of candidates per row) or "
            "score.group_column and score.candidate_column (one row per candidate), not both"
            if listed
            else "score: mode score needs score.candidates_column (a list of candidates per "
            "row), or score.group_column and score.candidate_column (one row per candidate)"
        )
    if grouped:
        for key in ("group_column", "candidate_column"):
            if names[key] is None:
                other = "candidate_column" if key == "group_column" else "group_column"
                raise JobError(f"score.{key}: missing required key (needed with score.{other})")
        if names["group_column"] == names["candidate_column"]:
            raise JobError("score.candidate_column: must differ from score.group_column")
    separator = get(sec, "score", "separator", "str", "")
    token_logprobs = get(sec, "score", "return_token_logprobs", "bool", False)
    sampling = raw.get("sampling")
    if isinstance(sampling, dict) and sampling:
        key = next(iter(sampling))
        raise JobError(
            f"sampling.{key}: score mode generates nothing, so sampling settings do not apply; "
            "remove the sampling section (or use mode: generate)"
        )
    if prompt.template is None and prompt.chat is None:
        raise JobError("prompt: score mode needs prompt.template or prompt.chat")
    if inp.format == "openai-batch":
        raise JobError("input.format: score mode reads parquet or jsonl rows, not openai-batch")
    if output.format != "parquet":
        raise JobError(f"output.format: score mode writes parquet, not {output.format}")
    return ScoreSpec(**names, separator=separator, return_token_logprobs=token_logprobs)
