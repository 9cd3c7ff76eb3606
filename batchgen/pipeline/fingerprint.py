"""Job fingerprint: a hash of everything that decides the output, split into named parts.

The model and the input files are fingerprinted by content (file_digest.py: every byte on
first sight, then cached by the file's identity), so a retrained checkpoint with the same
file sizes, or an input edited in place and touched back to its old mtime, is a changed job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from batchgen.job import JobSpec
from batchgen.models.errors import ModelLoadError
from batchgen.models.weight_files import find_weight_files
from batchgen.pipeline.file_digest import cached_digest, file_digest

# The files of a model directory, besides its weights, whose content decides the output.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
# Hashing more than this (not yet cached) is announced: about a second per GB from disk.
ANNOUNCE_BYTES = 1 << 30
HASH_THREADS = 4  # files hashed at once
# Engine options that change the numbers a model computes (other engine options, such as
# max_num_seqs, only change speed): part of the model fingerprint when not at their defaults.
NUMERIC_OPTIONS = {"kv_cache_dtype": "auto", "calibrate_kv_scales": 0, "quantization": None}


def _h(obj) -> str:
    data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def model_files(path: str) -> list[str]:
    """The files of model directory `path` that model_fingerprint reads: MODEL_FILES that
    exist, then every weight file the loader would read (pickle ones included, so a job that
    allows them is covered)."""
    found = [os.path.join(path, n) for n in MODEL_FILES if os.path.isfile(os.path.join(path, n))]
    try:
        weights = find_weight_files(path, allow_pickle=True)
    except ModelLoadError:
        weights = []  # no weights: the loader says so, with its own message
    return found + [w for w in weights if w not in found]


def digests(paths: list[str]) -> list[str]:
    """file_digest of each path, several files at once: xxhash releases the GIL, and parallel
    filesystems (Lustre, GPFS, NFS) give more bandwidth to several streams than to one."""
    if len(paths) < 2:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths))) as pool:
        return list(pool.map(file_digest, paths))


def model_fingerprint(path: str) -> str:
    """A digest of model directory `path` by content: {file name: file_digest} over
    model_files(path). Raises OSError for a file that cannot be read."""
    files = model_files(path)
    return _h({os.path.relpath(f, path): d for f, d in zip(files, digests(files))})


def input_fingerprint(files: list[str]) -> list[tuple[str, int, str]]:
    """(absolute path, size, content digest) per input file, in the given (reading) order."""
    return [(os.path.abspath(p), os.path.getsize(p), d) for p, d in zip(files, digests(files))]


def uncached_bytes(paths: list[str]) -> int:
    """How many bytes of `paths` file_digest would read now (those not cached as they are)."""
    return sum(os.path.getsize(p) for p in paths if cached_digest(p) is None)


def _model_part(job: JobSpec) -> dict:
    part = {"content": model_fingerprint(job.model.path), "dtype": job.model.dtype}
    options = dict(job.model.options)
    numerics = {k: options[k] for k, d in NUMERIC_OPTIONS.items() if options.get(k, d) != d}
    if numerics:  # absent otherwise, so jobs without them keep their fingerprints
        part["numerics"] = numerics
    return part


def fingerprint_parts(
    job: JobSpec, files: list[str], log: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Named hashes; a changed job is reported by the names whose hash differs."""
    if log is not None:
        todo = uncached_bytes(model_files(job.model.path) + list(files))
        if todo > ANNOUNCE_BYTES:
            log(
                f"fingerprinting {todo / 2**30:.1f} GiB of model and input files by content "
                "(once: later runs read the digests from the cache) ..."
            )
    spec = dataclasses.asdict(job.input)
    spec.pop("path")
    return {
        "model": _h(_model_part(job)),
        "input": _h({"files": input_fingerprint(files), "spec": spec}),
        "prompt": _h(dataclasses.asdict(job.prompt)),
        "sampling": _h(dataclasses.asdict(job.sampling)),
        "mode": _h(job.mode),
        "output.shard_rows": _h(job.output.shard_rows),
        "output.format": _h(job.output.format),
    }


def fingerprint(parts: dict[str, str]) -> str:
    return _h(parts)
