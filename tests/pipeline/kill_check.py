"""The durability promise, checked on an output directory after kills and reruns."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner
from kill_cycle import Task, run_once
from kill_data import SHARD_ROWS, Expected

from batchgen.cli import main
from batchgen.io.manifest import STALE_TEMP_S

# Temps of the files every task may write; README: a rerun removes them once 10 minutes old.
SHARED_TEMP = re.compile(r"^\.(_job\.json|_stats\.json|_SUCCESS)\.tmp-(\d+)-[0-9a-f]+$")


def listing(out: Path) -> list[str]:
    names = [n for n in os.listdir(out) if n != "_manifest"]
    return names + [f"_manifest/{n}" for n in os.listdir(out / "_manifest")]


def check_rows(out: Path, expected: Expected) -> None:
    """Shard k holds input rows k*SHARD_ROWS.. in order: every row exactly once, as a result
    (with text) or as the error record its input row calls for."""
    num_shards = -(-len(expected) // SHARD_ROWS)
    parts = [f"part-{k:05d}.parquet" for k in range(num_shards)]
    manifest = [f"_manifest/part-{k:05d}.json" for k in range(num_shards)]
    kept = {"_SUCCESS", "_job.json", "_plan.json", "_stats.json", *parts, *manifest}
    assert sorted(listing(out)) == sorted(kept)
    got: Expected = []
    for name in parts:
        table = pq.read_table(out / name).to_pydict()
        got += list(zip(table["id"], table["error_code"]))
        for text, code, error in zip(table["text"], table["error_code"], table["error"]):
            assert (text is None) == (code is not None) == (error is not None), name
    assert got == expected  # in input order; ok ids are unique, so none lost or duplicated


def check_status(out: Path, num_shards: int) -> None:
    res = CliRunner().invoke(main, ["status", str(out)])
    want = f"{out}: complete\nshards: {num_shards}/{num_shards} committed\n"
    assert res.exit_code == 0 and res.output.startswith(want), res.output


def shared_temps(out: Path) -> dict[str, int]:
    """Temps of shared files in `out`, with the pid that wrote each."""
    return {n: int(m.group(2)) for n in os.listdir(out) if (m := SHARED_TEMP.match(n))}


def age(out: Path, names) -> None:
    """Date files back past STALE_TEMP_S, as if the rerun came 10 minutes later."""
    old = time.time() - STALE_TEMP_S - 60
    for n in names:
        os.utime(out / n, (old, old))


def check_done(tasks: list[Task], expected: Expected) -> None:
    """After every task's last run exited 0: the job is complete and holds each row once."""
    out = tasks[0].out
    assert (out / "_SUCCESS").exists()
    left = shared_temps(out)
    if left:
        # Only a SIGKILL mid-write of a shared file may leave its temp: another task could be
        # writing it, so reruns remove it once 10 minutes old (README). Check that they do.
        killed = {
            r["pid"] for t in tasks for r in t.log if r["kill"] and r["kill"].sig == signal.SIGKILL
        }
        assert set(left.values()) <= killed, left
        age(out, left)
        committed = listing(out)
        run_once(tasks[0], None)
        assert sorted(listing(out)) == sorted(n for n in committed if n not in left)
    check_rows(out, expected)
    num_shards = -(-len(expected) // SHARD_ROWS)
    job = json.loads((out / "_job.json").read_text())
    assert (job["total_rows"], job["num_shards"]) == (len(expected), num_shards)
    check_status(out, num_shards)
