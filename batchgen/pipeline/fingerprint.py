"""Job fingerprint: a hash of everything that decides the output, split into named parts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from batchgen.job import JobSpec

_WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth")
_HASHED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Engine options that change the numbers a model computes (other engine options, such as
# max_num_seqs, only change speed): part of the fingerprint when not at their defaults.
_NUMERIC_OPTIONS = {"kv_cache_dtype": "auto", "calibrate_kv_scales": 0, "quantization": None}


def _h(obj) -> str:
    data = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _model_part(job: JobSpec) -> dict:
    path = job.model.path
    files = {}
    for name in _HASHED_FILES:
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    weights = sorted(
        (n, os.path.getsize(os.path.join(path, n)))
        for n in (os.listdir(path) if os.path.isdir(path) else [])
        if n.endswith(_WEIGHT_EXTS)
    )
    part = {"files": files, "weights": weights, "dtype": job.model.dtype}
    options = dict(job.model.options)
    numerics = {
        k: options[k]
        for k, default in _NUMERIC_OPTIONS.items()
        if options.get(k, default) != default
    }
    if numerics:  # absent otherwise, so jobs without them keep their fingerprints
        part["numerics"] = numerics
    return part


def _input_part(job: JobSpec, files: list[str]) -> dict:
    stats = []
    for p in files:
        st = os.stat(p)
        stats.append((os.path.abspath(p), st.st_size, st.st_mtime_ns))
    spec = dataclasses.asdict(job.input)
    spec.pop("path")
    return {"files": stats, "spec": spec}


def fingerprint_parts(job: JobSpec, files: list[str]) -> dict[str, str]:
    """Named hashes; a changed job is reported by the names whose hash differs."""
    return {
        "model": _h(_model_part(job)),
        "input": _h(_input_part(job, files)),
        "prompt": _h(dataclasses.asdict(job.prompt)),
        "sampling": _h(dataclasses.asdict(job.sampling)),
        "mode": _h(job.mode),
        "output.shard_rows": _h(job.output.shard_rows),
        "output.format": _h(job.output.format),
    }


def fingerprint(parts: dict[str, str]) -> str:
    return _h(parts)
