"""The job stage: a YAML job file read, overridden and validated into a frozen JobSpec.

`load.py` reads and validates, `spec.py` holds the dataclasses, `keys.py` the key and type
checks, `score.py` the `score:` section, `placeholders.py` the prompt's `{column}` names and
`yaml_loader.py` the YAML loader. Modules inside the package import from those files; the names
below are for callers outside it.
"""

from batchgen.job.load import apply_override, check_path, load_job, require_prompt, validate_job
from batchgen.job.spec import (
    ChatMessage,
    InputSpec,
    JobError,
    JobSpec,
    ModelSpec,
    OutputSpec,
    PromptSpec,
    SamplingSpec,
    ScoreSpec,
)

__all__ = [
    "ChatMessage",
    "InputSpec",
    "JobError",
    "JobSpec",
    "ModelSpec",
    "OutputSpec",
    "PromptSpec",
    "SamplingSpec",
    "ScoreSpec",
    "apply_override",
    "check_path",
    "load_job",
    "require_prompt",
    "validate_job",
]
