"""Plan once: the first task (or `batchgen plan`) scans the input; every task then reads only
its own shards' bytes. A changed input makes a new plan."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest
from click.testing import CliRunner
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.cli import main
from batchgen.io import readers, scan
from batchgen.job import JobError
from batchgen.pipeline import job_plan
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.signals import StopFlag


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def runner(job, **kw) -> Runner:
    return Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=512, max_num_seqs=8),
        tokenizer_factory=lambda j: FakeTokenizer(),
        **kw,
    )


READ_AHEAD = 1 << 16  # what buffered line reading may fetch past a shard's last line


class CountingFile(io.FileIO):
    """A raw file that adds every byte it reads from the OS to `counts[path]`."""

    counts: dict[str, int] = {}

    def readinto(self, buffer) -> int | None:
        n = super().readinto(buffer)
        CountingFile.counts[self.name] = CountingFile.counts.get(self.name, 0) + (n or 0)
        return n


def counting_open(path, mode="r", *args, **kw):
    assert mode == "rb", mode
    return io.BufferedReader(CountingFile(path, "r"))


def test_tasks_read_only_their_shards(tmp_path, monkeypatch, tiny_model_dir):
    data = [{**r, "topic": "pad " * 250} for r in rows(2000)]  # ~1 KB a row, 2 MB in all
    write_jsonl(tmp_path / "in.jsonl", data)
    model = {"path": tiny_model_dir("llama")}  # `batchgen plan` reads its tokenizer and config
    job_file = make_job(tmp_path, "in.jsonl", model=model, output={"shard_rows": 250})
    res = CliRunner().invoke(main, ["plan", str(job_file)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "2000 rows in 8 shard(s) of 250, 0 duplicate id(s)" in res.output
    plan_file = tmp_path / "out/_plan.json"
    planned = plan_file.stat()
    scans = []
    monkeypatch.setattr(job_plan, "scan", lambda *a, **k: scans.append(1) or scan.scan(*a, **k))
    monkeypatch.setattr(readers, "open", counting_open, raising=False)
    size = os.path.getsize("in.jsonl")
    lines = open("in.jsonl", "rb").readlines()
    starts = [sum(map(len, lines[: 250 * k])) for k in range(9)]
    head = sum(map(len, lines[:100]))
    for i in range(4):
        CountingFile.counts.clear()
        result = runner(load(job_file), shard=ShardSelector(i, 4)).run()
        assert result.exit_code == 0
        read = CountingFile.counts.get("in.jsonl", 0)
        own = sum(starts[k + 1] - starts[k] for k in (i, i + 4))  # shards i and i + 4
        # Its own two shards (a quarter of the file), some read-ahead past each, and the
        # first 100 lines (the job's column check reads them before the plan).
        most = own + head + 3 * READ_AHEAD
        assert own <= read <= most and read < 0.35 * size, (i, read, own, size)
    assert scans == [] and plan_file.stat().st_mtime_ns == planned.st_mtime_ns
    assert read_output("out")["id"].to_list() == [r["id"] for r in data]


def test_tasks_starting_together_plan_once(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", rows(300))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 50}))
    scans = []

    def slow_scan(*a, **k):
        scans.append(threading.current_thread().name)
        time.sleep(0.5)  # the others arrive while the plan is being made
        return scan.scan(*a, **k)

    monkeypatch.setattr(job_plan, "scan", slow_scan)
    logs: list[str] = []
    prepared = []

    def prepare(i: int) -> None:
        r = runner(job, shard=ShardSelector(i, 3), log=logs.append)
        r.prepare()
        r.keeper.close()
        prepared.append(r.plan)

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(scans) == 1 and len(prepared) == 3
    assert sum("waiting for the shard plan" in m for m in logs) == 2
    assert all(p.to_json() == prepared[0].to_json() for p in prepared)


def test_changed_input_makes_a_new_plan(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(100))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 30}))
    assert runner(job).run().complete
    before = json.loads((tmp_path / "out/_plan.json").read_text())
    assert (before["num_units"], before["num_shards"]) == (100, 4)
    write_jsonl(tmp_path / "in.jsonl", rows(130))
    with pytest.raises(JobError, match=r"changed: input"):
        runner(job).run()
    result = runner(job, overwrite=True).run()
    assert result.complete and result.num_shards == 5
    after = json.loads((tmp_path / "out/_plan.json").read_text())
    assert after["num_units"] == 130 and after["key"] != before["key"]
    assert read_output("out")["id"].to_list() == [r["id"] for r in rows(130)]


def test_a_stop_while_planning_exits_75_at_once(tmp_path, monkeypatch):
    # A preemption during a long scan must not wait for the scan's end.
    write_jsonl(tmp_path / "in.jsonl", rows(20_000))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 1000}))
    stop = StopFlag()
    read_line = readers.parse_line
    seen = []

    def parse_then_stop(*a):
        seen.append(1)
        if len(seen) == 5000:
            stop.set("SIGTERM")
        return read_line(*a)

    monkeypatch.setattr(scan, "parse_line", parse_then_stop)
    result = runner(job, stop=stop, plan_workers=1).run()
    assert result.exit_code == 75 and len(seen) < 10_000
    assert not os.path.exists("out/_plan.json") and not os.path.exists("out/_locks")
