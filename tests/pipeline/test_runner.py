"""End-to-end runs of the pipeline with the FakeEngine."""

from __future__ import annotations

import json
import os
import signal

import pytest
from fake_engine import FakeEngine, FakeTokenizer, fake_text
from workspace import (
    TEMPLATE,
    corrupt_column_chunk,
    load,
    make_job,
    read_output,
    rows,
    write_jsonl,
    write_parquet,
    write_row_groups,
)

from batchgen.engine.request_checks import ModelLimits
from batchgen.io import manifest
from batchgen.job import JobError
from batchgen.pipeline.runner import Runner
from batchgen.pipeline.sharding import ShardSelector
from batchgen.pipeline.signals import StopFlag
from batchgen.pipeline.validate import validate
from batchgen.plan.planner import row_seed

# polars reads and writes the Parquet these tests check. The GPU machine has none and runs only
# `pytest -m gpu`: there this module is skipped at collection instead of failing it.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def run(job, **kw):
    kw.setdefault("engine_factory", lambda j: FakeEngine(max_model_len=256, max_num_seqs=8))
    kw.setdefault("tokenizer_factory", lambda j: FakeTokenizer())
    return Runner(job, **kw).run()


def expected_text(row: dict, max_tokens: int = 8, seed=None) -> str:
    ids = FakeTokenizer().encode(TEMPLATE.format(text=row["text"]))
    return fake_text(ids, row_seed(seed, row["id"]), 0)[:max_tokens]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_end_to_end_ids_and_texts(tmp_path, fmt):
    data = rows(500)
    writer = write_jsonl if fmt == "jsonl" else write_parquet
    writer(tmp_path / f"in/data.{fmt}", data)
    result = run(load(make_job(tmp_path, f"in/data.{fmt}")))
    assert result.exit_code == 0 and result.complete
    assert sorted(os.listdir("out"))[:2] == ["_SUCCESS", "_job.json"]
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) == 10
    df = read_output("out")
    assert df["id"].to_list() == [r["id"] for r in data]
    assert df["text"].to_list() == [expected_text(r) for r in data]
    assert df["topic"].to_list() == [r["topic"] for r in data]
    assert df["error"].null_count() == 500
    first = pl.read_parquet("out/part-00003.parquet")
    assert first["id"].to_list() == [r["id"] for r in data[150:200]]
    stats = json.loads((tmp_path / "out/_stats.json").read_text())
    assert stats["job"]["ok"] == 500 and stats["job"]["num_generated_tokens"] == 500 * 8


def test_directory_of_mixed_files_keeps_file_then_row_order(tmp_path):
    write_jsonl(tmp_path / "in/a.jsonl", rows(70, "a"))
    write_parquet(tmp_path / "in/b.parquet", rows(40, "b"))
    result = run(load(make_job(tmp_path, "in")))
    assert result.complete
    ids = read_output("out")["id"].to_list()
    assert ids == [r["id"] for r in rows(70, "a") + rows(40, "b")]


def test_malformed_input_rows_become_error_records(tmp_path):
    good = rows(20)
    lines = [json.dumps(r).encode() for r in good]
    lines[3] = b'{"id": "broken", "text": '
    lines[5] = json.dumps({"text": "no id"}).encode()
    lines[7] = json.dumps({"id": good[1]["id"], "text": "dup"}).encode()
    lines[9] = json.dumps({"id": "nulltext", "text": None}).encode()
    lines[11] = b'{"id": "latin1", "text": "caf\xe9"}'
    lines[13] = json.dumps({"id": "long", "text": "x" * 400}).encode()
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = run(load(make_job(tmp_path, "in.jsonl")))
    assert result.exit_code == 0 and result.totals["errors"] == 6
    df = read_output("out")
    assert df.height == 20
    codes = dict(zip(range(20), df["error_code"].to_list()))
    assert [codes[i] for i in (3, 5, 7, 9, 11, 13)] == [
        "bad_json",
        "missing_id",
        "duplicate_id",
        "null_text",
        "invalid_utf8",
        "prompt_too_long",
    ]
    errors = df.filter(pl.col("error_code").is_not_null())
    assert errors["text"].null_count() == 6
    assert set(errors["finish_reason"].to_list()) == {"error"}
    assert "in.jsonl:4" in errors["error"][0]
    ok = df.filter(pl.col("error_code").is_null())
    assert ok.height == 14 and ok["text"].null_count() == 0


def test_corrupt_parquet_row_group_is_error_records_not_a_crash(tmp_path):
    p = write_row_groups(tmp_path / "in.parquet", 30, 10)
    corrupt_column_chunk(p, 1, 1)  # the text of rows 10-19
    job = load(make_job(tmp_path, "in.parquet", input={"columns": []}))
    report = validate(
        job, tokenizer_factory=lambda j: FakeTokenizer(), limits_fn=lambda j: ModelLimits(256, 259)
    )
    assert (report.rows, report.ok, dict(report.errors)) == (30, 20, {"bad_parquet": 10})
    result = run(job)
    assert result.exit_code == 0 and result.complete and result.totals["errors"] == 10
    df = read_output("out")
    assert df["id"].to_list() == [f"r{i}" for i in range(30)]
    assert df["error_code"].to_list() == [None] * 10 + ["bad_parquet"] * 10 + [None] * 10
    assert "in.parquet:row 10: rows 10-19 of this file cannot be decoded" in df["error"][10]


def test_two_shard_tasks_are_disjoint_and_cover_the_input(tmp_path):
    data = rows(230)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl"))
    first = run(job, shard=ShardSelector(0, 2))
    assert not first.complete
    files0 = {p.name for p in (tmp_path / "out").glob("part-*")}
    second = run(job, shard=ShardSelector(1, 2))
    assert second.complete and (tmp_path / "out/_SUCCESS").exists()
    files1 = {p.name for p in (tmp_path / "out").glob("part-*")} - files0
    assert files0 == {"part-00000.parquet", "part-00002.parquet", "part-00004.parquet"}
    assert files1 == {"part-00001.parquet", "part-00003.parquet"}
    assert read_output("out")["id"].to_list() == [r["id"] for r in data]


def test_stop_that_leaves_unstarted_shards_is_not_success(tmp_path):
    # The stop arrives while shard 1 is read, with shards 2-11 never opened: the finished rows
    # of the open shards are kept, and the run must exit 75 (requeue), not 0.
    data = rows(60)
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl", output={"shard_rows": 5}))
    stop = StopFlag()
    runner = Runner(
        job,
        engine_factory=lambda j: FakeEngine(max_model_len=256, max_num_seqs=2),
        tokenizer_factory=lambda j: FakeTokenizer(),
        stop=stop,
        max_in_flight=8,
        chunk_rows=7,
    )
    read_shard = runner.read_shard

    def read_then_stop(k: int):
        if k == 1:
            stop.set("SIGTERM")
        return read_shard(k)

    runner.read_shard = read_then_stop
    first = runner.run()
    assert first.exit_code == 75 and not first.complete
    assert any("interrupted by SIGTERM" in line for line in first.lines)
    assert first.stats.shards_committed + first.stats.pieces_committed >= 1
    again = run(job)
    assert again.exit_code == 0 and again.complete
    assert read_output("out")["id"].to_list() == [r["id"] for r in data]
    assert sorted(os.listdir("out")) == [
        "_SUCCESS", "_job.json", "_manifest", "_plan.json", "_stats.json",
        *(f"part-{k:05d}.parquet" for k in range(12)),
    ]  # fmt: skip


def test_resume_skips_committed_shards(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl"))
    run(job)
    engine = FakeEngine()
    again = run(job, engine_factory=lambda j: engine)
    assert again.stats.shards_skipped == 3 and again.stats.shards_committed == 0
    assert engine.added == []


def test_changed_job_refused_then_overwritten(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(60))
    run(load(make_job(tmp_path, "in.jsonl")))
    changed = load(make_job(tmp_path, "in.jsonl"), "sampling.max_tokens=4")
    with pytest.raises(JobError, match=r"different job \(changed: sampling\).*--overwrite"):
        run(changed)
    result = run(changed, overwrite=True)
    assert result.complete
    assert set(read_output("out")["text"].str.len_chars().to_list()) == {4}


def test_foreign_non_empty_output_dir_refused(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    (tmp_path / "out").mkdir()
    (tmp_path / "out/notes.txt").write_text("mine")
    with pytest.raises(JobError, match="not empty and holds no batchgen output"):
        run(load(make_job(tmp_path, "in.jsonl")))
    assert run(load(make_job(tmp_path, "in.jsonl")), overwrite=True).complete
    assert (tmp_path / "out/notes.txt").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_dir_holding_an_input_file_refused(tmp_path, overwrite):
    # Spark-style inputs named like shards: the run must neither replace nor delete them.
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data/part-00000.jsonl", rows(5))
    before = (tmp_path / "data/part-00000.jsonl").read_bytes()
    job = load(make_job(tmp_path, "data", output={"path": "data"}))
    with pytest.raises(JobError, match="holds the input file .*part-00000.jsonl"):
        run(job, overwrite=overwrite)
    assert (tmp_path / "data/part-00000.jsonl").read_bytes() == before
    assert os.listdir(tmp_path / "data") == ["part-00000.jsonl"]


def test_dir_left_with_only_a_job_file_temp_is_ours(tmp_path):
    # A first run killed while writing _job.json (or a concurrent task writing it now) leaves
    # only its temp: the directory is still batchgen's, not a foreign one.
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    (tmp_path / "out").mkdir()
    (tmp_path / "out/._job.json.tmp-4242-0a1b2c3d").write_text("{")
    assert run(load(make_job(tmp_path, "in.jsonl"))).complete


def test_sigterm_while_preparing_exits_75(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))

    def tokenizer_then_sigterm(job):
        os.kill(os.getpid(), signal.SIGTERM)  # caught: the stop handlers are already in place
        return FakeTokenizer()

    result = run(load(make_job(tmp_path, "in.jsonl")), tokenizer_factory=tokenizer_then_sigterm)
    assert result.exit_code == 75 and not result.complete


def test_sigterm_while_writing_success_is_caught(tmp_path, monkeypatch):
    # Every shard is committed; the signal lands while _SUCCESS is written. Uncaught, it ended
    # the process (exit -15, no _SUCCESS, its temp left for 10 minutes).
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    mark_success = manifest.mark_success_if_complete

    def sigterm_then_mark(*args):
        # Sent only while caught: uncaught, SIGTERM would end the test process itself.
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "SIGTERM not caught"
        os.kill(os.getpid(), signal.SIGTERM)
        return mark_success(*args)

    monkeypatch.setattr(manifest, "mark_success_if_complete", sigterm_then_mark)
    result = run(load(make_job(tmp_path, "in.jsonl")))
    assert result.exit_code == 0 and result.complete
    assert sorted(os.listdir(tmp_path / "out")) == [
        "_SUCCESS",
        "_job.json",
        "_manifest",
        "_plan.json",
        "_stats.json",
        "part-00000.parquet",
    ]


def test_output_path_that_is_a_file_refused(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(5))
    (tmp_path / "out").write_text("a file")
    with pytest.raises(JobError, match="exists and is not a directory"):
        run(load(make_job(tmp_path, "in.jsonl")))


def test_parquet_inputs_that_agree_keep_their_dtype(tmp_path):
    data = [{**r, "topic": i} for i, r in enumerate(rows(8))]
    write_parquet(tmp_path / "in/a.parquet", data[:4])
    write_parquet(tmp_path / "in/b.parquet", data[4:])
    run(load(make_job(tmp_path, "in", output={"shard_rows": 3})))
    for part in sorted((tmp_path / "out").glob("part-*.parquet")):
        assert pl.read_parquet_schema(part)["topic"] == pl.Int64
    assert read_output("out")["topic"].to_list() == list(range(8))


def test_passthrough_types_that_differ_become_text_in_every_shard(tmp_path):
    # int64 in one Parquet file, strings in the other: nothing may turn into null, and every
    # shard must share one schema (a reader of the whole directory needs that).
    data = rows(6)
    write_parquet(tmp_path / "in/a.parquet", [{**r, "topic": i} for i, r in enumerate(data[:3])])
    write_parquet(tmp_path / "in/b.parquet", data[3:])
    logs = []
    run(load(make_job(tmp_path, "in", output={"shard_rows": 2})), log=logs.append)
    assert any("'topic' has several types" in line for line in logs)
    assert read_output("out")["topic"].to_list() == ["0", "1", "2", "a", "b", "c"]
    # JSONL: numbers in one shard, strings and objects in the next.
    values = [1, 2, "x", {"k": [1, True]}, None, 2.5]
    write_jsonl(tmp_path / "in.jsonl", [{**r, "topic": v} for r, v in zip(rows(6), values)])
    run(load(make_job(tmp_path, "in.jsonl", output={"path": "out2", "shard_rows": 2})))
    schemas = {str(pl.read_parquet_schema(p)) for p in (tmp_path / "out2").glob("part-*")}
    assert len(schemas) == 1
    got = pl.read_parquet(tmp_path / "out2/*.parquet")["topic"].to_list()
    assert got == ["1", "2", "x", '{"k": [1, true]}', None, "2.5"]


def test_n_samples_are_lists(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(10))
    job = load(
        make_job(tmp_path, "in.jsonl"),
        "sampling.n=3",
        "sampling.temperature=0.8",
        "sampling.seed=1234",
    )
    run(job)
    df = read_output("out")
    assert df.schema["text"] == pl.List(pl.String)
    assert all(len(t) == 3 and len(set(t)) == 3 for t in df["text"].to_list())
    assert df["num_output_tokens"].to_list()[0] == [8, 8, 8]


def test_per_row_overrides_and_bad_params(tmp_path):
    data = rows(4)
    data[1]["params"] = json.dumps({"max_tokens": 3})
    data[2]["params"] = json.dumps({"temprature": 3})
    data[3]["params"] = json.dumps({"max_tokens": 0})
    write_jsonl(tmp_path / "in.jsonl", data)
    job = load(make_job(tmp_path, "in.jsonl", sampling={"overrides_column": "params"}))
    run(job)
    df = read_output("out")
    assert df["error_code"].to_list() == [None, None, "bad_params", "bad_params"]
    assert len(df["text"][1]) == 3
    assert "max_tokens" in df["error"][3]


def test_openai_batch_in_and_out(tmp_path):
    lines = [
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
            },
        },
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Once upon", "max_tokens": 6, "n": 2, "temperature": 1.0},
        },
        {"custom_id": "c3", "method": "POST", "url": "/v1/embeddings", "body": {}},
    ]
    write_jsonl(tmp_path / "batch.jsonl", lines)
    job = load(
        make_job(
            tmp_path,
            "batch.jsonl",
            prompt=None,
            input={"path": "batch.jsonl", "columns": []},
            output={"format": "openai-batch"},
        )
    )
    assert run(job).complete
    out = [json.loads(x) for x in (tmp_path / "out/part-00000.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["c1", "c2", "c3"]
    chat = out[0]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert len(chat["choices"][0]["message"]["content"]) == 5
    text = out[1]["response"]["body"]
    assert text["object"] == "text_completion" and len(text["choices"]) == 2
    assert out[2]["response"] is None and out[2]["error"]["code"] == "bad_params"
