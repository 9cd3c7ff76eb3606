"""Writer and manifest: atomic shard files, entries, verification, stray temp cleanup."""

from __future__ import annotations

import json
import os

import pytest

from batchgen.io import manifest
from batchgen.io.rows import ResultRow
from batchgen.io.writer import ShardLayout, write_shard

# polars reads and writes the Parquet these tests check. The GPU machine has none and runs only
# `pytest -m gpu`: there this module is skipped at collection instead of failing it.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")


def results():
    return [
        ResultRow(1, "b", {"topic": None}, "t1", "stop", num_prompt_tokens=3, num_output_tokens=2),
        ResultRow(0, "a", {"topic": "x"}, "t0", "length", num_prompt_tokens=4, num_output_tokens=5),
        ResultRow(2, None, {}, error="f:3: broken", error_code="bad_json"),
    ]


def test_parquet_shard_columns_and_order(tmp_path):
    entry = write_shard(str(tmp_path), 3, results(), ShardLayout((("topic", None),)))
    assert entry["file"] == "part-00003.parquet"
    df = pl.read_parquet(tmp_path / "part-00003.parquet")
    assert df.columns == [
        "id",
        "topic",
        "text",
        "finish_reason",
        "error",
        "error_code",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
    ]
    assert df["id"].to_list() == ["a", "b", None]
    assert df["finish_reason"].to_list() == ["length", "stop", "error"]
    assert df["topic"].dtype == pl.String
    assert os.path.getsize(tmp_path / "part-00003.parquet") == entry["size"]
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []


def test_multi_layout_error_row(tmp_path):
    rows = [
        ResultRow(0, "a", {}, ["x", "y"], ["stop", "length"], num_output_tokens=[1, 2]),
        ResultRow(1, "b", {}, error="e", error_code="bad_params"),
    ]
    write_shard(str(tmp_path), 0, rows, ShardLayout(multi=True))
    df = pl.read_parquet(tmp_path / "part-00000.parquet")
    assert df["text"].to_list() == [["x", "y"], None]
    assert df["finish_reason"].to_list() == [["stop", "length"], ["error"]]


def test_openai_jsonl_shard(tmp_path):
    entry = write_shard(str(tmp_path), 0, results(), ShardLayout(fmt="openai-batch", model="m"))
    lines = [json.loads(x) for x in (tmp_path / entry["file"]).read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "b", None]
    assert lines[0]["response"]["body"]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
    }
    assert lines[2]["error"]["code"] == "bad_json"


def test_manifest_verify_and_cleanup(tmp_path):
    out = str(tmp_path)
    entry = write_shard(out, 0, results(), ShardLayout())
    manifest.write_entry(out, 0, {**entry, "rows": 3, "fingerprint": "f1"})
    assert set(manifest.committed_shards(out, "f1")) == {0}
    assert manifest.committed_shards(out, "other") == {}
    data = (tmp_path / "part-00000.parquet").read_bytes()
    (tmp_path / "part-00000.parquet").write_bytes(data[: len(data) // 2])
    assert manifest.committed_shards(out, "f1") == {}
    (tmp_path / ".part-00001.parquet.tmp-1-aa").write_text("x")
    (tmp_path / ".part-00002.parquet.tmp-1-bb").write_text("x")
    removed = manifest.remove_stray_temps(out, lambda k: k % 2 == 1)
    assert removed == [".part-00001.parquet.tmp-1-aa"]
    assert manifest.mark_success_if_complete(out, "f1", 1) is False
    manifest.clear_outputs(out)
    assert os.listdir(out) == []


def test_shared_file_temps_removed_only_when_stale(tmp_path):
    out = str(tmp_path)
    names = ["._job.json.tmp-1-aa", "._stats.json.tmp-2-bb", "._SUCCESS.tmp-3-cc"]
    for name in names:
        (tmp_path / name).write_text("x")
    mtime = os.path.getmtime(tmp_path / names[0])
    # Another task may be writing these right now: kept while young.
    assert manifest.remove_stray_temps(out, lambda k: True, now=mtime + 5) == []
    stale = mtime + manifest.STALE_TEMP_S + 1
    assert sorted(manifest.remove_stray_temps(out, lambda k: False, now=stale)) == sorted(names)
    assert os.listdir(out) == []


def test_shared_file_temp_of_an_ended_writer_on_this_host_goes_at_once(tmp_path):
    import subprocess
    import sys

    from batchgen.io import atomic

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(ended.stdout)
    tag = atomic.HOST_TAG
    other = "0" * 6 if tag != "0" * 6 else "1" * 6
    gone = f"._SUCCESS.tmp-{dead_pid}-{tag}abcdef"  # this host, writer ended
    alive = f"._job.json.tmp-{os.getpid()}-{tag}abcdef"  # this host, writer running (us)
    elsewhere = f"._stats.json.tmp-{dead_pid}-{other}abcdef"  # another host: age decides
    for name in (gone, alive, elsewhere):
        (tmp_path / name).write_text("x")
    mtime = os.path.getmtime(tmp_path / gone)
    assert manifest.remove_stray_temps(str(tmp_path), lambda k: False, now=mtime + 5) == [gone]
    assert sorted(os.listdir(tmp_path)) == sorted([alive, elsewhere])
    # The temp names batchgen writes carry this host's tag, and match the cleanup's pattern.
    name = os.path.basename(atomic.temp_path(str(tmp_path / "_SUCCESS")))
    assert name.startswith(f"._SUCCESS.tmp-{os.getpid()}-{tag}")
    assert manifest._TEMP.match(name)


def test_a_failed_parquet_write_names_the_shard_in_the_errnos_words(tmp_path, monkeypatch):
    # pyarrow's own error for a full disk (as pq.write_table raises it on /dev/full): errno
    # 28, no file name, its words wrapped in Arrow's.
    from batchgen.io import writer

    def full(table, where, **kw):
        raise OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(writer.pq, "write_table", full)
    with pytest.raises(OSError) as got:
        write_shard(str(tmp_path), 2, results(), ShardLayout((("topic", None),)))
    e = got.value
    assert e.errno == 28
    assert e.filename == str(tmp_path / "part-00002.parquet")
    assert e.strerror == "No space left on device"
    assert os.listdir(tmp_path) == []  # the temp file is gone
