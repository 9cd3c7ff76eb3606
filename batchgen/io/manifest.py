"""Manifest: the job fingerprint (`_job.json`) and one entry file per committed shard.

One file per shard (`_manifest/part-00003.json`) instead of one shared manifest means that
concurrent Slurm tasks never read-modify-write the same file, so no update can be lost. A
shard's part file and then its entry are published with link() (never replacing a file), so
the first commit of a shard wins. A shard counts as committed only if its entry exists, names
the current fingerprint, and its data file exists with the recorded size and row count (for
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
from batchgen.io.locks import LOCK_DIR
from batchgen.io.pieces import PARTIAL_DIR, PIECE

JOB_FILE = "_job.json"
PLAN_FILE = "_plan.json"
MANIFEST_DIR = "_manifest"
SUCCESS_FILE = "_SUCCESS"
STATS_FILE = "_stats.json"
KV_SCALES_FILE = (
    "_kv_scales.json"  # FP8 K/V-cache scales a job calibrated (pipeline/kv_scales_file)
)
SHARED_FILES = (JOB_FILE, PLAN_FILE, SUCCESS_FILE, STATS_FILE, KV_SCALES_FILE)
# The exact names batchgen writes: shard files, their manifest entries, pieces, and the temp
# files of either (atomic.temp_path: "." + name + ".tmp-<pid>-<hex>"). Nothing else is ever
# deleted.
_SHARD = re.compile(r"^part-(\d{5})\.(parquet|jsonl)$")
_ENTRY = re.compile(r"^part-(\d{5})\.json$")
_TEMP = re.compile(
    r"^\.(part-(\d{5})(\.p\d{4,})?\.(parquet|jsonl|json)|_job\.json|_stats\.json|_kv_scales\.json|_SUCCESS"
    r"|_plan\.json|[\w.-]+\.lock)"
    + re.escape(atomic.TMP_MARK)
    + r"(?P<pid>\d+)-(?P<token>[0-9a-f]+)$"
)
_BROKEN_LOCK = re.compile(r"^[\w.-]+\.lock\.(broken-[0-9a-f]+|breaking)$")


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


def json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def planted_links(out_dir: str) -> list[str]:
    """Symlinks among the names batchgen reads and writes in out_dir and in its _manifest/,
    _partial/ and _locks/ (the plan, entries, pieces, lock and claim files, temps of each):
    batchgen creates none, and following one would read or write outside the directory."""
    found = []
    if not os.path.isdir(out_dir):
        return found
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if (name in _DIRS or _written_by_batchgen(name)) and os.path.islink(path):
            found.append(path)
    for sub, ours in _SUBDIR_NAMES.items():
        d = own_subdir(out_dir, sub)
        for name in os.listdir(d) if d is not None else []:
            path = os.path.join(d, name)
            if ours(name) and os.path.islink(path):
                found.append(path)
    return sorted(found)


def check_no_links(out_dir: str) -> None:
    """Raise JobError naming any symlink planted where batchgen reads or writes."""
    links = planted_links(out_dir)
    if links:
        raise atomic.link_refused(", ".join(links[:4]) + (" ..." if len(links) > 4 else ""))


def own_subdir(out_dir: str, name: str) -> str | None:
    """out_dir/name (_manifest, _partial, _locks) if it is a real directory (not a symlink),
    else None: nothing is read from, written to or removed in a planted link's target."""
    d = os.path.join(out_dir, name)
    return d if os.path.isdir(d) and not os.path.islink(d) else None


def _manifest_dir(out_dir: str) -> str | None:
    return own_subdir(out_dir, MANIFEST_DIR)


def write_json(path: str, obj: dict) -> None:
    atomic.write_bytes(path, json_bytes(obj))


def read_job(out_dir: str) -> dict | None:
    return _read_json(os.path.join(out_dir, JOB_FILE))


def write_job(out_dir: str, job: dict) -> None:
    write_json(os.path.join(out_dir, JOB_FILE), job)


def read_stats(out_dir: str) -> dict | None:
    """`_stats.json` (job totals and the last run's numbers), or None."""
    return _read_json(os.path.join(out_dir, STATS_FILE))


def entry_path(out_dir: str, k: int) -> str:
    return os.path.join(out_dir, MANIFEST_DIR, f"part-{k:05d}.json")


def write_entry(out_dir: str, k: int, entry: dict[str, Any]) -> None:
    os.makedirs(os.path.join(out_dir, MANIFEST_DIR), exist_ok=True)
    if _manifest_dir(out_dir) is None:  # a symlink planted since the run's start
        check_no_links(out_dir)
    write_json(entry_path(out_dir, k), {**entry, "shard": k, "committed_at": time.time()})


def publish_entry(out_dir: str, k: int, entry: dict[str, Any]) -> dict:
    """Create shard k's entry unless one exists; returns the entry in place. An existing
    entry that does not describe the data file now committed (left by an earlier commit
    whose data was removed) is replaced: the data file is the commit, the entry its record."""
    atomic.own_dir(os.path.join(out_dir, MANIFEST_DIR))
    record = {**entry, "shard": k, "committed_at": time.time()}
    path = entry_path(out_dir, k)
    if atomic.publish_bytes(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()):
        return record
    old = _read_json(path)
    if old is not None and verify_entry(out_dir, old, str(entry.get("fingerprint"))):
        return old
    write_json(path, record)
    return record


def read_entries_of(out_dir: str, k: int) -> dict | None:
    """Shard k's entry, if present (not verified)."""
    return _read_json(entry_path(out_dir, k))


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


def committed_shards(out_dir: str, fingerprint: str, only=None) -> dict[int, dict]:
    """Verified entries by shard number (of the shards `only(k)` is true for, if given)."""
    entries = read_entries(out_dir)
    return {
        k: e
        for k, e in entries.items()
        if (only is None or only(k)) and verify_entry(out_dir, e, fingerprint)
    }


def entry_names(out_dir: str) -> set[int]:
    """Shards with an entry file (one listing, nothing read or verified)."""
    d = _manifest_dir(out_dir)
    names = os.listdir(d) if d is not None else []
    return {int(m.group(1)) for n in names if (m := _ENTRY.match(n))}


# A temp of a shared file (_job.json, _stats.json, _SUCCESS) may be another task's write in
# progress; one this old is a crash's leftover (such a write takes milliseconds), and so is one
# whose writer ran on this host and has ended (atomic.writer_is_gone), at any age.
STALE_TEMP_S = 600.0


def remove_stray_temps(out_dir: str, owns, now: float | None = None) -> list[str]:
    """Delete temp files left by a crash: those of shards for which `owns(k)` (no other live
    process writes them: committed shards, shards this process holds the lock of), and the
    others once STALE_TEMP_S old or once their writer, a process of this host, has ended."""
    now = time.time() if now is None else now
    removed = []
    for d, name, k, pid, token in list_temps(out_dir):
        path = os.path.join(d, name)
        stray = k is not None and owns(k)
        if not stray:
            try:
                stray = now - os.path.getmtime(path) > STALE_TEMP_S
            except OSError:
                continue  # renamed into place meanwhile
            stray = stray or (pid is not None and atomic.writer_is_gone(pid, token))
        if stray:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(name)
    return removed


def list_temps(out_dir: str) -> list[tuple[str, str, int | None, int | None, str]]:
    """(directory, name, shard or None, writer pid, token) of every temp file batchgen may
    have left in the output directory, its manifest, pieces and locks."""
    found = []
    dirs = (out_dir, *(own_subdir(out_dir, d) for d in (MANIFEST_DIR, PARTIAL_DIR, LOCK_DIR)))
    for d in dirs:
        for name in os.listdir(d) if d is not None and os.path.isdir(d) else []:
            m = _TEMP.match(name)
            if m is not None:
                k = int(m.group(2)) if m.group(2) is not None and d != dirs[3] else None
                found.append((d, name, k, int(m["pid"]), m["token"]))
            elif d == dirs[3] and _BROKEN_LOCK.match(name):
                found.append((d, name, None, None, ""))
    return found


def _written_by_batchgen(name: str) -> bool:
    """A file name batchgen writes in the output directory: a shard, a shared file, or a
    temp of either."""
    return name in SHARED_FILES or bool(_SHARD.match(name) or _TEMP.match(name))


_DIRS = (MANIFEST_DIR, PARTIAL_DIR, LOCK_DIR)
# What batchgen writes inside each subdirectory (planted_links): entries, pieces, locks (the
# claim mutex and run locks among them), a broken lock set aside, and temps of each.
_SUBDIR_NAMES = {
    MANIFEST_DIR: lambda n: bool(_ENTRY.match(n) or _TEMP.match(n)),
    PARTIAL_DIR: lambda n: bool(PIECE.match(n) or _TEMP.match(n)),
    LOCK_DIR: lambda n: n.endswith(".lock") or bool(_TEMP.match(n) or _BROKEN_LOCK.match(n)),
}


def foreign_names(out_dir: str) -> list[str]:
    """Entries of out_dir that batchgen does not write (temps included as batchgen's)."""
    return [n for n in os.listdir(out_dir) if not (n in _DIRS or _written_by_batchgen(n))]


def is_batchgen_dir(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, JOB_FILE)) or os.path.isdir(
        os.path.join(out_dir, MANIFEST_DIR)
    )


def has_results(out_dir: str) -> bool:
    """Whether any shard file, entry or piece (of any job) is in the output directory."""
    if any(_SHARD.match(n) for n in os.listdir(out_dir)):
        return True
    for sub, pattern in ((MANIFEST_DIR, _ENTRY), (PARTIAL_DIR, PIECE)):
        d = os.path.join(out_dir, sub)
        if os.path.isdir(d) and any(pattern.match(n) for n in os.listdir(d)):
            return True
    return False


def clear_outputs(out_dir: str) -> None:
    """--overwrite: remove a previous job's outputs, only files with the exact names batchgen
    writes (a user's `part-00000.jsonl.bak` or other files stay); `_manifest/` and
    `_partial/` go if that leaves them empty. Lock files stay (live ones are a run's)."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.islink(path):
            continue  # neither a link nor what it points to is ours
        if name in (MANIFEST_DIR, PARTIAL_DIR) and os.path.isdir(path):
            pattern = _ENTRY if name == MANIFEST_DIR else PIECE
            for sub in os.listdir(path):
                if pattern.match(sub) or _TEMP.match(sub):
                    os.unlink(os.path.join(path, sub))
            if not os.listdir(path):
                os.rmdir(path)
        elif os.path.isfile(path) and _written_by_batchgen(name):
            os.unlink(path)
    atomic.fsync_dir(out_dir)


def mark_success_if_complete(out_dir: str, fingerprint: str, num_shards: int) -> bool:
    """Write `_SUCCESS` if every shard of the job is committed; any task may call this. Only
    once every entry exists are they read and verified (most tasks of a large array end
    before the last shard is committed)."""
    if len(entry_names(out_dir) & set(range(num_shards))) < num_shards:
        return False
    done = committed_shards(out_dir, fingerprint)
    if any(k not in done for k in range(num_shards)):
        return False
    atomic.write_bytes(os.path.join(out_dir, SUCCESS_FILE), b"")
    return True
