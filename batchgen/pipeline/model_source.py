"""The job's model as a local directory: `model.path` resolved once (hub ids fetched or found
in the hub cache) by `run` and `validate` alike, before anything reads the model."""

from __future__ import annotations

from dataclasses import replace

from batchgen.job import JobError, JobSpec
from batchgen.models.errors import ModelLoadError
from batchgen.models.hub import resolve_model


def resolve_job_model(job: JobSpec) -> JobSpec:
    """The job with `model.path` a local directory (hub ids: their snapshot in the hub cache,
    the id kept as `model.hub_id` for the outputs); raises JobError naming the key."""
    spec = job.model
    if spec.hub_id is not None:  # already resolved
        return job
    try:
        local = resolve_model(spec.path, spec.revision)
    except ModelLoadError as e:
        raise JobError(f"{job.source}: model.path: {e}") from None
    if local == spec.path:
        return job
    return replace(job, model=replace(spec, path=local, hub_id=spec.path))
