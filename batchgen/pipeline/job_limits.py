"""The job file's settings against the model's limits (config.json): job errors before weights.

`batchgen run` and `batchgen validate` both call check_job_limits once the model's config is
read, so a `sampling:` value that every row would fail with, or a KV cache the engine would
refuse at start-up, stops the job before any model loads, naming the job file and the key.
"""

from __future__ import annotations

from batchgen.engine.request_checks import ModelLimits, check_cache_size, check_params
from batchgen.job import JobError, JobSpec
from batchgen.sampling_params import SamplingParams


def check_job_limits(job: JobSpec, limits: ModelLimits) -> None:
    """Raise JobError if the job's own settings cannot run on this model."""
    engine = job.model.engine_config()
    if engine.num_kv_blocks is not None:  # else the cache is sized from memory at load
        too_small = check_cache_size(engine.num_kv_blocks * engine.block_size, limits.max_model_len)
        if too_small is not None:
            raise JobError(f"{job.source}: model.num_kv_blocks={engine.num_kv_blocks}: {too_small}")
    if job.mode == "score":
        return  # score jobs have no sampling section
    given = job.sampling.base_params()
    # validate_job built these params once already, so this cannot raise.
    params = SamplingParams(**given)
    error = check_params(params, limits)
    # A field left at its default is checked per row instead: a row's overrides may set it.
    if error is not None and error.field in given:
        raise JobError(f"{job.source}: sampling.{error.message}")
    if params.structured_outputs is not None:
        # The schema, regex or grammar itself: one the grammar engine refuses would fail
        # every row. (batchgen validate also compiles it against the tokenizer.)
        # Imported here: llguidance is needed only by jobs with a constraint.
        from batchgen.engine.structured.grammar import check_constraint

        refused = check_constraint(params.structured_outputs)
        if refused is not None:
            raise JobError(f"{job.source}: sampling.{refused}")
