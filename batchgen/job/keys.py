"""Reading a job mapping's sections and keys: unknown-key hints and simple type checks."""

from __future__ import annotations

import difflib
from typing import Any

from batchgen.job.spec import JobError
from batchgen.short_repr import short_repr


def unknown_key(path: str, key: Any, known: list[str]) -> JobError:
    hint = difflib.get_close_matches(str(key), known, n=1)
    extra = f" (did you mean {hint[0]!r}?)" if hint else f" (known keys: {', '.join(known)})"
    return JobError(f"{path}.{key}: unknown key{extra}" if path else f"{key}: unknown key{extra}")


def section(raw: dict, name: str, known: list[str], required: bool = True) -> dict:
    sec = raw.get(name)
    if sec is None:
        if required:
            raise JobError(f"{name}: missing required section")
        return {}
    if not isinstance(sec, dict):
        raise JobError(f"{name}: expected a mapping, got {type(sec).__name__}")
    for key in sec:
        if key not in known:
            raise unknown_key(name, key, known)
    return sec


TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def check_type(path: str, value: Any, annotation: str) -> Any:
    """Check a value against a simple annotation string such as 'int | None' or 'float'."""
    alts = [a.strip() for a in annotation.split("|")]
    if value is None and "None" in alts:
        return value
    for alt in alts:
        if alt in TYPES and isinstance(value, TYPES[alt]):
            if alt != "bool" and isinstance(value, bool):
                continue
            return float(value) if alt == "float" and "int" not in alts else value
        if alt.startswith("tuple[") and isinstance(value, (list, tuple, str)):
            return value
    want = " or ".join("null" if a == "None" else a.replace("tuple[", "list[") for a in alts)
    raise JobError(f"{path}: expected {want}, got {type(value).__name__} {short_repr(value)}")


def get(sec: dict, path: str, key: str, annotation: str, default: Any = ..., choices=None):
    if key not in sec or sec[key] is None and default is not ...:
        if default is ...:
            raise JobError(f"{path}.{key}: missing required key")
        return default
    value = check_type(f"{path}.{key}", sec[key], annotation)
    if choices is not None and value not in choices:
        raise JobError(
            f"{path}.{key}: {short_repr(value)} is not one of {', '.join(map(str, choices))}"
        )
    return value
