"""Manifest: the job fingerprint (`_job.json`) and one entry file per committed shard.

One file per shard (`_manifest/part-00003.json`) instead of one shared manifest means that
concurrent Slurm tasks never read-modify-write the same file, so no update can be lost; each
file is replaced atomically. A shard counts as committed only if its entry exists, names the
current fingerprint, and its data file exists with the recorded size and row count (for
Parquet, a readable footer).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pyarrow.parquet as pq

from batchgen.io import atomic
from batchgen.job import JobError

JOB_FILE = "_job.json"
MANIFEST_DIR = "_manifest"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "_stats.json"
KV_SCALES_FILE = (
    "_kv_scales.json"  # FP8 K/V-cache scales a job calibrated (pipeline/kv_scales_file)
)
# The exact names batchgen writes: shard files, their manifest entries, and the temp files of
# either (atomic.temp_path: "." + name + ".tmp-<pid>-<hex>"). Nothing else is ever deleted.
_SHARD = re.compile(r"^part-(\d{5})\.(parquet|jsonl)$")
_ENTRY = re.compile(r"^part-(\d{5})\.json$")
_TEMP = re.compile(
    r"^\.(part-(\d{5})\.(parquet|jsonl|json)|_job\.json|_stats\.json|_kv_scales\.json|_SUCCESS)"
    + re.escape(atomic.TMP_MARK)
    + r"(?P<pid>\d+)-(?P<token>[0-9a-f]+)$"
)


def _read_json(path: str) -> dict | None:
    """A JSON object batchgen wrote, or None; a symlink is never followed (O_NOFOLLOW):
    batchgen creates none, so one in the output directory is someone else's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def planted_links(out_dir: str) -> list[str]:
    """Symlinks among the names batchgen reads and writes in out_dir (and in its _manifest/):
    batchgen creates none, and following one would read or write outside the directory."""
    found = []
    if not os.path.isdir(out_dir):
        return found
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if (name == MANIFEST_DIR or _written_by_batchgen(name)) and os.path.islink(path):
            found.append(path)
    d = os.path.join(out_dir, MANIFEST_DIR)
    if os.path.isdir(d) and not os.path.islink(d):
        for name in os.listdir(d):
            path = os.path.join(d, name)
            if (_ENTRY.match(name) or _TEMP.match(name)) and os.path.islink(path):
                found.append(path)
    return sorted(found)


def check_no_links(out_dir: str) -> None:
    """Raise JobError naming any symlink planted where batchgen reads or writes."""
    links = planted_links(out_dir)
    if links:
        shown = ", ".join(links[:4]) + (" ..." if len(links) > 4 else "")
        raise JobError(
            f"output.path: {shown} is a symlink, which batchgen never creates and does not "
            "follow inside its output directory; remove it (the file it points to is not "
            "touched)"
        )


def _manifest_dir(out_dir: str) -> str | None:
    """out_dir/_manifest if it is a real directory (not a symlink), else None."""
    d = os.path.join(out_dir, MANIFEST_DIR)
    return d if os.path.isdir(d) and not os.path.islink(d) else None


def write_json(path: str, obj: dict) -> None:
    atomic.write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_job(out_dir: str) -> dict | None:
    return _read_json(os.path.join(out_dir, JOB_FILE))


def write_job(out_dir: str, job: dict) -> None:
    write_json(os.path.join(out_dir, JOB_FILE), job)


def entry_path(out_dir: str, k: int) -> str:
    return os.path.join(out_dir, MANIFEST_DIR, f"part-{k:05d}.json")


def write_entry(out_dir: str, k: int, entry: dict[str, Any]) -> None:
    os.makedirs(os.path.join(out_dir, MANIFEST_DIR), exist_ok=True)
    if _manifest_dir(out_dir) is None:  # a symlink planted since the run's start
        check_no_links(out_dir)
    write_json(entry_path(out_dir, k), {**entry, "shard": k, "committed_at": time.time()})


def read_entries(out_dir: str) -> dict[int, dict]:
    """All shard entries present (not verified); none through a symlinked _manifest/."""
    d = _manifest_dir(out_dir)
    out = {}
    for name in os.listdir(d) if d is not None else []:
        m = _ENTRY.match(name)
        if m and (e := _read_json(os.path.join(d, name))) is not None:
            out[int(m.group(1))] = e
    return out


def verify_entry(out_dir: str, entry: dict, fingerprint: str) -> bool:
    """True if the entry belongs to this job and its data file is intact."""
    if entry.get("fingerprint") != fingerprint:
        return False
    path = os.path.join(out_dir, str(entry.get("file", "")))
    try:
        if os.path.islink(path) or os.path.getsize(path) != entry.get("size"):
            return False
        if path.endswith(".parquet"):
            return pq.read_metadata(path).num_rows == entry.get("rows")
        with open(path, "rb") as f:
            return sum(1 for _ in f) == entry.get("rows")
    except Exception:
        return False


def committed_shards(out_dir: str, fingerprint: str) -> dict[int, dict]:
    """Verified entries by shard number."""
    return {k: e for k, e in read_entries(out_dir).items() if verify_entry(out_dir, e, fingerprint)}


# A temp of a shared file (_job.json, _stats.json, _SUCCESS) may be another task's write in
# progress; one this old is a crash's leftover (such a write takes milliseconds), and so is one
# whose writer ran on this host and has ended (atomic.writer_is_gone), at any age.
STALE_TEMP_S = 600.0


def remove_stray_temps(out_dir: str, owns, now: float | None = None) -> list[str]:
    """Delete temp files left by a crash: those of shards this task owns (`owns(k) -> bool`:
    no other task writes them), and those of the shared files once STALE_TEMP_S old or once
    their writer, a process of this host, has ended."""
    now = time.time() if now is None else now
    removed = []
    for d in (out_dir, _manifest_dir(out_dir)):
        for name in os.listdir(d) if d is not None and os.path.isdir(d) else []:
            m = _TEMP.match(name)
            if m is None:
                continue
            path = os.path.join(d, name)
            if m.group(2) is not None:
                stray = owns(int(m.group(2)))
            else:
                try:
                    stray = now - os.path.getmtime(path) > STALE_TEMP_S
                except OSError:
                    continue  # renamed into place meanwhile
                stray = stray or atomic.writer_is_gone(int(m["pid"]), m["token"])
            if stray:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                removed.append(name)
    return removed


def _written_by_batchgen(name: str) -> bool:
    """A file name batchgen writes in the output directory: a shard, a shared file, or a
    temp of either."""
    return name in (JOB_FILE, SUCCESS_FILE, STATS_FILE, KV_SCALES_FILE) or bool(
        _SHARD.match(name) or _TEMP.match(name)
    )


def foreign_names(out_dir: str) -> list[str]:
    """Entries of out_dir that batchgen does not write (temps included as batchgen's)."""
    return [n for n in os.listdir(out_dir) if not (n == MANIFEST_DIR or _written_by_batchgen(n))]


def is_batchgen_dir(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, JOB_FILE)) or os.path.isdir(
        os.path.join(out_dir, MANIFEST_DIR)
    )


def clear_outputs(out_dir: str) -> None:
    """--overwrite: remove a previous job's outputs, only files with the exact names batchgen
    writes (a user's `part-00000.jsonl.bak` or other files stay); `_manifest/` goes if that
    leaves it empty."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.islink(path):
            continue  # neither a link nor what it points to is ours
        if name == MANIFEST_DIR and os.path.isdir(path):
            for sub in os.listdir(path):
                if _ENTRY.match(sub) or _TEMP.match(sub):
                    os.unlink(os.path.join(path, sub))
            if not os.listdir(path):
                os.rmdir(path)
        elif os.path.isfile(path) and _written_by_batchgen(name):
            os.unlink(path)
    atomic.fsync_dir(out_dir)


def mark_success_if_complete(out_dir: str, fingerprint: str, num_shards: int) -> bool:
    """Write `_SUCCESS` if every shard of the job is committed; any task may call this."""
    done = committed_shards(out_dir, fingerprint)
    if any(k not in done for k in range(num_shards)):
        return False
    atomic.write_bytes(os.path.join(out_dir, SUCCESS_FILE), b"")
    return True
