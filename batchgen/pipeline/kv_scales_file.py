"""`_kv_scales.json`: the FP8 K/V-cache scales a job calibrated, kept in its output directory so
that every task and every resume of the job runs with the same scales.

The first task to calibrate creates the file (a temp file linked into place, which fails if the
name exists); a task that finds it, or loses that race, uses the file's scales, so all tasks
agree even where two calibrations would round differently (another GPU model).
"""

from __future__ import annotations

import json
import math
import os

from batchgen.io import atomic
from batchgen.io.manifest import KV_SCALES_FILE


def read(out_dir: str, fingerprint: str) -> list[list[float]] | None:
    """The stored scales if the file belongs to this job (its fingerprint), else None."""
    try:
        with open(os.path.join(out_dir, KV_SCALES_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint:
        return None
    scales = record.get("scales")
    ok = isinstance(scales, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and all(isinstance(x, (int, float)) and 0 < x < math.inf for x in p)
        for p in scales
    )
    return scales if ok and scales else None


def write_if_absent(out_dir: str, record: dict) -> None:
    """Create the file with `record` unless it exists (then leave it: another task wrote it)."""
    final = os.path.join(out_dir, KV_SCALES_FILE)
    tmp = atomic.temp_path(final)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)  # atomic, and refuses an existing name
        except FileExistsError:
            return
        atomic.fsync_dir(out_dir)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
