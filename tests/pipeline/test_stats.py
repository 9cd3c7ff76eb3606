"""_stats.json when Slurm tasks finish together: the last writer's totals include every shard
committed before it wrote."""

from __future__ import annotations

import json

from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.stats import RunStats, job_totals, summary_lines, write_stats


def entry(rows: int, generated: int) -> dict:
    return {
        "rows": rows,
        "ok": rows,
        "errors": 0,
        "num_prompt_tokens": 10 * rows,
        "num_cached_tokens": 0,
        "num_generated_tokens": generated,
    }


def test_stats_rewritten_when_another_task_commits_meanwhile(tmp_path):
    # This task reads shards {0, 1}; task 1 commits shard 2 before this task's write lands.
    # The re-read after the write sees shard 2, so the file is written again with it.
    views = [{0: entry(4, 40), 1: entry(4, 44)}]
    views.append({**views[0], 2: entry(3, 30)})
    reads = []

    def read_entries():
        reads.append(len(reads))
        return views[min(len(reads) - 1, 1)]

    stats = write_stats(str(tmp_path), RunStats(rows_ok=8), read_entries, "0/2")
    on_disk = json.loads((tmp_path / "_stats.json").read_text())
    assert on_disk == stats
    assert on_disk["job"]["shards"] == 3
    assert on_disk["job"]["ok"] == 11
    assert on_disk["job"]["num_generated_tokens"] == 114
    assert on_disk["last_run"]["task"] == "0/2" and on_disk["last_run"]["rows_ok"] == 8
    assert len(reads) == 3  # stale read, the re-read that found shard 2, the settled re-read


def test_stats_written_once_when_nothing_changes(tmp_path):
    reads = []

    def read_entries():
        reads.append(1)
        return {0: entry(2, 5)}

    stats = write_stats(str(tmp_path), RunStats(), read_entries, "all")
    assert stats["job"]["shards"] == 1 and stats["job"]["num_generated_tokens"] == 5
    assert len(reads) == 2


def test_summary_lines_are_the_tasks_with_a_job_line_when_sharded():
    run = RunStats(shards_committed=1, shards_skipped=1)
    task = job_totals({0: entry(4, 40), 2: {**entry(4, 4), "ok": 3, "errors": 1}})
    job = job_totals({0: entry(4, 40), 1: entry(4, 0), 2: {**entry(4, 4), "ok": 3, "errors": 1}})
    lines = summary_lines(run, task, job, 5, ShardSelector(0, 2))
    assert lines[0] == "shards committed: 2/3 of task 0/2 (this run: 1, already done: 1)"
    assert lines[1] == "rows of task 0/2: 7 ok, 1 error(s)"
    assert lines[2].startswith("tokens of task 0/2: 80 prompt") and "44 generated" in lines[2]
    assert lines[-1] == "job (all tasks): 3/5 shards committed, rows: 11 ok, 1 error(s)"
    # Input not read to the end: shard counts unknown.
    assert summary_lines(run, task, job, None, ShardSelector(1, 2))[0].startswith(
        "shards committed: 2/? of task 1/2"
    )
    # One task is the whole job: no task label, no job line.
    alone = summary_lines(run, job, job, 3, ShardSelector())
    assert alone[:2] == [
        "shards committed: 3/3 (this run: 1, already done: 1)",
        "rows: 11 ok, 1 error(s)",
    ]
    assert len(alone) == 4 and not any("job" in line for line in alone)
