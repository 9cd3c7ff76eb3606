"""Progress and status: the bar's total is the rows owed, status knows the shard count, a no-op
rerun keeps the last real run's numbers, commits record a timeline, `status --plot`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from fake_engine import FakeEngine, FakeTokenizer
from test_partial import StoppingEngine
from workspace import load, make_job, rows, write_jsonl

from batchgen import cli
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.signals import StopFlag
from batchgen.pipeline.status import status_lines
from batchgen.pipeline.timeline import Event, job_events, throughput

pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")

N, SHARD_ROWS = 300, 50  # 6 shards


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def runner(job, engine=None, **kw) -> Runner:
    engine = engine or FakeEngine(max_model_len=256, max_num_seqs=8)
    return Runner(
        job, engine_factory=lambda j: engine, tokenizer_factory=lambda j: FakeTokenizer(), **kw
    )


def stopped_midway(tmp_path):
    """A job stopped after some shards committed and some rows kept in pieces."""
    write_jsonl(tmp_path / "in.jsonl", rows(N))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": SHARD_ROWS}))
    stop = StopFlag()
    engine = StoppingEngine(stop, after=20, max_model_len=256, max_num_seqs=8)
    first = runner(job, engine, stop=stop, max_in_flight=16).run()
    assert first.exit_code == 75
    return job


def rows_on_disk(pattern: str) -> int:
    """Rows of the Parquet files matching `pattern`, read from their footers."""
    return sum(pq.read_metadata(p).num_rows for p in Path(".").glob(pattern))


def test_bar_total_is_the_rows_a_resume_owes(tmp_path, capsys):
    job = stopped_midway(tmp_path)
    committed = rows_on_disk("out/part-*.parquet")
    in_pieces = rows_on_disk("out/_partial/*.parquet")
    assert committed > 0 and in_pieces > 0  # both kinds of finished rows are there
    owed = N - committed - in_pieces
    capsys.readouterr()
    again = runner(job, progress=True)
    assert again.run().exit_code == 0
    assert again.progress.total == owed and again.progress.rows == owed
    bar = capsys.readouterr().err
    # tqdm's bar: done/total, elapsed<ETA, rows/s and generated tok/s.
    assert re.search(rf"\| {owed}/{owed} \[\d\d:\d\d<\d\d:\d\d, [\d.]+row/s", bar), bar[-400:]
    assert "gen tok/s" in bar


def test_status_knows_the_shard_count_from_the_plan(tmp_path):
    stopped_midway(tmp_path)
    done = len(list(Path("out").glob("part-*.parquet")))
    assert 0 < done < 6
    assert f"shards: {done}/6 committed" in status_lines("out")
    # A _job.json written before the plan (no shard count): the plan still gives it.
    record = json.loads(Path("out/_job.json").read_text())
    Path("out/_job.json").write_text(json.dumps({**record, "num_shards": None}))
    assert f"shards: {done}/6 committed" in status_lines("out")


def test_status_after_plan_only(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 50}))
    r = runner(job)
    r.prepare()  # what `batchgen plan` does: claim and plan, no model
    r.keeper.close()
    r.renderer.close()
    lines = status_lines("out")
    assert "shards: 0/3 committed" in lines and not any("?" in line for line in lines)


def test_noop_rerun_keeps_the_last_real_runs_numbers(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 50}))
    first = runner(job).run()
    assert first.complete and first.stats.rows_ok == 120
    before = json.loads(Path("out/_stats.json").read_text())
    assert before["last_run"]["rows_ok"] == 120 and before["last_run"]["wall_s"] > 0
    again = runner(job).run()
    assert again.exit_code == 0 and again.stats.did_nothing
    after = json.loads(Path("out/_stats.json").read_text())
    assert after == before
    last = (
        f"last run (task 0/1): 120 rows in {before['last_run']['wall_s']:.1f} s, "
        f"{before['last_run']['tokens_per_s']:.1f} generated tok/s"
    )
    assert "nothing to do: every shard was already committed" in again.lines
    assert last in again.lines and not any(x.startswith("this run:") for x in again.lines)
    assert last in status_lines("out")
    # A run that does work again replaces them: one shard redone.
    for name in ("out/part-00001.parquet", "out/_manifest/part-00001.json", "out/_SUCCESS"):
        Path(name).unlink()
    redo = runner(job).run()
    assert redo.complete and not any(x.startswith("nothing to do") for x in redo.lines)
    now = json.loads(Path("out/_stats.json").read_text())["last_run"]
    assert now["rows_ok"] == 50 and now["shards_committed"] == 1


def test_every_row_has_one_timeline_event_across_stop_and_resume(tmp_path):
    job = stopped_midway(tmp_path)
    assert runner(job).run().complete
    entries = [json.loads(p.read_text()) for p in sorted(Path("out/_manifest").glob("*.json"))]
    events = [e for entry in entries for e in entry["timeline"]]
    assert sum(e["rows"] for e in events) == N
    generated = sum(entry["num_generated_tokens"] for entry in entries)
    assert sum(e["generated_tokens"] for e in events) == generated
    assert all(e["started"] <= e["at"] and e["task"] == "0/1" and e["host"] for e in events)
    # The shard that had a piece: the first run's event, then the resume's.
    resumed = [entry["timeline"] for entry in entries if len(entry["timeline"]) > 1]
    assert resumed
    for timeline in resumed:
        runs = [e["run_started"] for e in timeline]
        assert runs[0] < runs[-1] and timeline[0]["at"] < timeline[-1]["at"]
    fp = json.loads(Path("out/_job.json").read_text())["fingerprint"]
    found, untimed = job_events("out", fp)
    assert untimed == 0 and sum(e.rows for e in found) == N


def test_throughput_spreads_each_commit_over_its_interval():
    # A: 100 tokens made over [0, 10]; B: 50 over [5, 10] (two shards in flight at once).
    def ev(start, at, tokens):
        return Event(at=at, started=start, rows=1, generated_tokens=tokens, task="", host="",
                     run_started=0.0)  # fmt: skip

    edges, rates = throughput([ev(0, 10, 100), ev(5, 10, 50)], bins=2)
    assert edges == [0.0, 5.0, 10.0]
    assert rates == pytest.approx([50 / 5, (50 + 50) / 5])
    # Bins finer than the intervals: the tokens add up to the total, whatever the bins.
    edges, rates = throughput([ev(0, 10, 100), ev(5, 10, 50), ev(2, 3, 7)], bins=7)
    width = edges[1] - edges[0]
    assert sum(r * width for r in rates) == pytest.approx(157)


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", rows(60))
    assert runner(load(make_job(tmp_path, "in.jsonl"))).run().complete
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    res = CliRunner().invoke(cli.main, ["status", "out", "--plot", "t.png"])
    assert res.exit_code == 2
    assert "--plot needs matplotlib" in res.output and "pip install 'batchgen[plot]'" in res.output
    assert not Path("t.png").exists()


def test_plot_mid_run_draws_committed_shards_and_pieces(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    stopped_midway(tmp_path)
    res = CliRunner().invoke(cli.main, ["status", "out", "--plot", "mid.png"])
    assert res.exit_code == 0, res.output
    shards = len(list(Path("out/_manifest").glob("*.json")))
    pieces = len(list(Path("out/_partial").glob("*.json")))
    assert f"plot: wrote mid.png ({shards + pieces} commit(s) from 1 run(s))" in res.output
    assert Path("mid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
