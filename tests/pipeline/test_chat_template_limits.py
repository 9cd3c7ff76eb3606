"""Runs and `validate` with hostile chat templates: bounded rows, a stop that never waits."""

from __future__ import annotations

import threading
import time

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.engine.request_checks import ModelLimits
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.signals import StopFlag
from batchgen.pipeline.validate import validate
from batchgen.plan.prompts import TemplateLimits

# Good rows render in milliseconds; 2 s leaves a loaded machine room, the hung rows cost 3 s.
LOOP = '{% set s = "x" * 100000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}'
GOOD = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
# Hangs on rows whose text starts with "bad", renders the others (and check()'s probe).
HANG_ON_BAD = "{% if messages[0].content.startswith('bad') %}" + LOOP + "{% endif %}" + GOOD


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def chat_job(tmp_path, data, template: str):
    write_jsonl(tmp_path / "in.jsonl", data)
    chat = {"chat": [{"role": "user", "content": "{text}"}], "chat_template": template}
    return load(make_job(tmp_path, "in.jsonl", prompt=chat, output={"shard_rows": 4}))


def test_a_hung_template_row_is_a_template_error_and_the_others_run(tmp_path):
    data = rows(10)
    data[3]["text"] = "bad row"
    job = chat_job(tmp_path, data, HANG_ON_BAD)
    result = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=256),
        tokenizer_factory=lambda j: FakeTokenizer(),
        template_limits=TemplateLimits(timeout_s=2.0),
    ).run()
    assert result.complete
    out = read_output("out")
    assert out["id"].to_list() == [r["id"] for r in data]
    codes = dict(zip(out["id"], out["error_code"]))
    assert codes.pop(data[3]["id"]) == "template_error"
    assert set(codes.values()) == {None}


def test_stop_during_a_hung_render_exits_75_at_once_and_resumes(tmp_path):
    data = rows(12)
    data[9]["text"] = "bad row"  # shard 2 (rows 8-11) hangs; shards 0 and 1 are rendered
    job = chat_job(tmp_path, data, HANG_ON_BAD)
    stop = StopFlag()
    runner = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=256),
        tokenizer_factory=lambda j: FakeTokenizer(),
        stop=stop,
        template_limits=TemplateLimits(timeout_s=120.0),  # only the stop can end the render
    )
    planner_calls = []

    def stop_when_rendering_shard_2():
        while not any(k == 2 for k in planner_calls):
            time.sleep(0.05)
        time.sleep(0.5)  # the worker is inside the endless loop now
        stop.set("SIGTERM")

    read_shard = runner.read_shard

    def recording_read_shard(k):  # a shard's rows are read, then rendered
        planner_calls.append(k)
        return read_shard(k)

    runner.read_shard = recording_read_shard
    threading.Thread(target=stop_when_rendering_shard_2, daemon=True).start()
    start = time.monotonic()
    result = runner.run()
    assert time.monotonic() - start < 60  # the render's own limit is 120 s
    assert result.exit_code == 75 and not result.complete
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == [
        "part-00000.parquet",
        "part-00001.parquet",
    ]
    # The same command again resumes: shards 0 and 1 are kept, shard 2 is owed and committed
    # (its hung row now a template_error under a short limit), no row twice.
    engine = FakeEngine(max_model_len=256)
    again = Runner(
        job,
        engine_factory=lambda j: engine,
        tokenizer_factory=lambda j: FakeTokenizer(),
        template_limits=TemplateLimits(timeout_s=2.0),
    ).run()
    assert again.complete and again.stats.shards_skipped == 2
    out = read_output("out")
    assert out["id"].to_list() == [r["id"] for r in data]
    assert out["error_code"].to_list()[9] == "template_error"
    assert sorted(engine.added) == ["2/10", "2/11", "2/8"]


def test_validate_ends_a_hung_template_as_a_row_error(tmp_path):
    data = rows(3)
    data[1]["text"] = "bad row"
    job = chat_job(tmp_path, data, HANG_ON_BAD)
    start = time.monotonic()
    report = validate(
        job,
        tokenizer_factory=lambda j: FakeTokenizer(),
        limits_fn=lambda j: ModelLimits(256, FakeTokenizer.vocab_size),
        template_limits=TemplateLimits(timeout_s=2.0),
    )
    assert time.monotonic() - start < 30
    assert report.rows == 3 and report.ok == 2
    assert dict(report.errors) == {"template_error": 1}
