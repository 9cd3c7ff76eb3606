"""The JSON files that keep kernel tunings between processes (gemm_tuning.json, int4_tuning.json
under the user's cache directory): {"version": V, "results": {key: record}}.

Reading keeps only the records `valid` accepts (anything else is timed again); a file that
cannot be read, or of another version, gives nothing. Writing merges with the records on disk
(tensor-parallel ranks tune their own shapes at once and each saves; none may drop another's),
this process's records winning, and replaces the file atomically. Neither ever raises on a bad
or unwritable file: a tuning cache is an optimization, so it warns and carries on.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable

from batchgen.io.atomic import write_bytes


def _valid_records(data, version: int, valid: Callable[[object], bool]) -> dict[str, dict]:
    if not isinstance(data, dict) or data.get("version") != version:
        return {}
    results = data.get("results")
    if not isinstance(results, dict):
        return {}
    return {k: v for k, v in results.items() if valid(v)}


def read_records(
    path: str, version: int, valid: Callable[[object], bool], what: str
) -> dict[str, dict]:
    """The valid records of the cache file at `path` ({} if it is missing or unreadable, with a
    warning naming `what` and the path when it exists but cannot be parsed)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return _valid_records(json.load(f), version, valid)
    except (OSError, ValueError) as exc:
        warnings.warn(f"{what} {path} skipped: {exc}", stacklevel=3)
        return {}


def write_records(
    path: str, version: int, records: dict[str, dict], valid: Callable[[object], bool], what: str
) -> None:
    """Write `records` over the valid ones already in the file (a warning if it cannot)."""
    on_disk: dict[str, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            on_disk = _valid_records(json.load(f), version, valid)
    except (OSError, ValueError):
        pass
    data = {"version": version, "results": {**on_disk, **records}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_bytes(path, json.dumps(data, indent=0, sort_keys=True).encode())
    except OSError as exc:
        warnings.warn(f"{what} {path} not written: {exc}", stacklevel=3)
