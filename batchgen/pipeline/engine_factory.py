"""The one place the pipeline touches the real engine and tokenizer (imported lazily).

Tests and the lead's real-engine tests swap these through the Runner's `engine_factory` /
`tokenizer_factory` arguments instead of patching deeper code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from batchgen.engine.request_checks import ModelLimits
from batchgen.job import JobError, JobSpec
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams


class TokenizerLike(Protocol):
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]: ...


class EngineLike(Protocol):
    """What the runner needs from an engine (batchgen.engine.llm_engine.LLMEngine has it)."""

    tokenizer: Any
    max_model_len: int
    limits: ModelLimits  # what add_request checks; the planner checks every row against it
    stats: Any

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...


def build_engine(job: JobSpec) -> EngineLike:
    """Load the job's model into an LLMEngine (the expensive step; runs after all checks)."""
    from batchgen.config import ConfigError
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.models.errors import ModelLoadError

    try:
        return LLMEngine(job.model.engine_config())
    except (ModelLoadError, ConfigError) as e:
        raise JobError(f"model: {e}") from None


def build_tokenizer(job: JobSpec) -> TokenizerLike:
    """The model's tokenizer alone (cheap; used to check prompts before the model loads)."""
    from batchgen.models.errors import ModelLoadError
    from batchgen.models.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(job.model.path)
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None


def structured_check(tokenizer, limits: ModelLimits) -> Callable[[Any], str | None]:
    """constraint -> why the grammar engine refuses it, or None (`batchgen validate`'s check).
    Compiled against the tokenizer's vocabulary when it is the real one (the grammar engine
    indexes tokenizer.json, about a second at 150k tokens, only once a row needs it); the
    grammar alone otherwise."""
    from batchgen.engine.structured.grammar import GrammarCompiler, check_constraint

    compiler = None

    def check(constraint) -> str | None:
        nonlocal compiler
        if not hasattr(tokenizer, "to_json") or limits.vocab_size is None:
            return check_constraint(constraint)
        if compiler is None:
            eos = getattr(tokenizer, "eos_token_ids", ())
            compiler = GrammarCompiler(tokenizer.to_json(), limits.vocab_size, eos)
        return compiler.check(constraint)

    return check


def model_limits(job: JobSpec) -> ModelLimits:
    """The limits the engine will check requests against, from config.json, once config.json
    is checked against the weight files' headers (no weights are read). A directory without
    weight files (config and tokenizer copied to validate a job elsewhere) skips that
    comparison; a run on it fails when the model loads, before anything is allocated."""
    from batchgen.config import ConfigError
    from batchgen.engine.tensor_parallel import check_tensor_parallel
    from batchgen.models.checkpoint_check import check_checkpoint
    from batchgen.models.config import ModelConfig
    from batchgen.models.errors import ModelLoadError
    from batchgen.models.quantization import load_plan
    from batchgen.models.weight_files import has_weight_files

    engine = job.model.engine_config()
    try:
        mc = ModelConfig.from_dir(job.model.path)
        # A quantization_config batchgen cannot run fails here, before the weights load.
        load_plan(mc, engine.quantization, f"{job.model.path}/config.json")
        if has_weight_files(job.model.path):  # (a 4-bit one must split over the ranks too)
            check_checkpoint(job.model.path, mc, engine.allow_pickle, engine.tensor_parallel_size)
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None
    try:  # a tensor_parallel_size this model or machine cannot take, before anything loads
        check_tensor_parallel(engine, mc)
    except ConfigError as e:
        raise JobError(f"{job.source}: model.{e}") from None
    except ModelLoadError as e:  # FP8 weight blocks the ranks would cut
        raise JobError(f"model.path: {e}") from None
    return ModelLimits.of(mc.max_position_embeddings, mc.vocab_size, engine.max_model_len)
