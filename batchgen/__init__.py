"""batchgen: offline batch LLM generation — jobs in, sharded resumable Parquet out."""

from __future__ import annotations

import os

from batchgen.cpu_threads import quiet_openmp_waits
from batchgen.outputs import CompletionOutput, RequestOutput, ScoreOutput
from batchgen.sampling_params import SamplingParams
from batchgen.structured_outputs import StructuredOutputsParams

# Before torch can be imported through batchgen (LLM, the CLI; none of the imports above loads
# it): OpenMP reads its wait policy once, when torch loads it, and its default spin-waiting
# collapses CPU runs on a shared machine (cpu_threads.py).
quiet_openmp_waits()

# Run from a plain checkout (PYTHONPATH=repo), `batchgen.kernels` must resolve to the repo's
# top-level kernels/ directory, which an install maps into this namespace instead. Never expose
# kernels/ as a top-level `kernels` package: that name belongs to Hugging Face's package.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "kernels")) and os.path.isfile(
    os.path.join(_root, "kernels", "ops.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own __path__

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "ScoreOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it lazily so `batchgen validate` stays light.
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
