"""Symlinks planted in the output directory are never followed: batchgen creates none."""

from __future__ import annotations

import json
import os

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from workspace import load, make_job, read_output, rows, write_jsonl

from batchgen.io import manifest
from batchgen.job import JobError
from batchgen.pipeline.runner import Runner


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def run(job, **kw):
    kw.setdefault("engine_factory", lambda j: FakeEngine(max_model_len=256))
    kw.setdefault("tokenizer_factory", lambda j: FakeTokenizer())
    return Runner(job, **kw).run()


def snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def elsewhere(tmp_path):
    """A directory outside the output, holding what a link would lead batchgen to."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "part-00000.json").write_text(json.dumps({"file": "x", "fingerprint": "f"}))
    (other / ".part-00001.json.tmp-1-abc").write_text("a temp-like name batchgen would delete")
    (other / "notes.txt").write_text("the user's own file")
    return other


@pytest.mark.parametrize("overwrite", [False, True])
def test_planted_manifest_link_is_refused_and_its_target_untouched(tmp_path, overwrite):
    write_jsonl(tmp_path / "in.jsonl", rows(120))
    job = load(make_job(tmp_path, "in.jsonl"))
    other = elsewhere(tmp_path)
    before = snapshot(other)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_manifest").symlink_to(other, target_is_directory=True)
    with pytest.raises(JobError, match=r"out/_manifest is a symlink, which batchgen never"):
        run(job, overwrite=overwrite)
    assert snapshot(other) == before
    assert os.path.islink(tmp_path / "out" / "_manifest")  # not ours to remove either
    (tmp_path / "out" / "_manifest").unlink()
    assert run(job).complete


def test_links_at_shard_and_entry_names_are_refused(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", rows(60))
    job = load(make_job(tmp_path, "in.jsonl"))
    assert run(job).complete
    other = elsewhere(tmp_path)
    shard = tmp_path / "out" / "part-00000.parquet"
    shard.rename(other / "part-00000.parquet")
    shard.symlink_to(other / "part-00000.parquet")
    with pytest.raises(JobError, match=r"out/part-00000.parquet is a symlink"):
        run(job)
    shard.unlink()
    entry = tmp_path / "out" / "_manifest" / "part-00001.json"
    entry.rename(other / "part-00001.json")
    entry.symlink_to(other / "part-00001.json")
    with pytest.raises(JobError, match=r"out/_manifest/part-00001.json is a symlink"):
        run(job)
    entry.unlink()
    assert run(job).complete  # the two shards are owed again, and written
    assert read_output("out")["id"].to_list() == [r["id"] for r in rows(60)]


def test_manifest_reads_never_follow_links(tmp_path):
    # Defence in depth, for a link planted after the run's start check.
    out = tmp_path / "out"
    (out / "_manifest").mkdir(parents=True)
    other = elsewhere(tmp_path)
    (out / "_job.json").symlink_to(other / "part-00000.json")
    assert manifest.read_job(str(out)) is None
    (out / "_manifest" / "part-00000.json").symlink_to(other / "part-00000.json")
    assert manifest.read_entries(str(out)) == {}
    (out / "_manifest" / "part-00000.json").unlink()
    (out / "_manifest").rmdir()
    (out / "_manifest").symlink_to(other, target_is_directory=True)
    assert manifest.read_entries(str(out)) == {}
    before = snapshot(other)
    assert manifest.remove_stray_temps(str(out), lambda k: True, now=1e12) == []
    with pytest.raises(JobError, match="_manifest is a symlink"):
        manifest.write_entry(str(out), 0, {"file": "part-00000.parquet"})
    assert snapshot(other) == before


@pytest.mark.parametrize(
    "name",
    [
        "_plan.json",
        "_locks",
        "_partial",
        "_locks/_claim.lock",
        "_locks/part-00000.lock",
        "_locks/.part-00000.lock.tmp-1-abc",
        "_partial/part-00000.p0001.json",
        "_partial/part-00000.p0001.parquet",
    ],
)
def test_links_at_plan_lock_claim_and_piece_names_are_refused(tmp_path, name):
    write_jsonl(tmp_path / "in.jsonl", rows(30))
    job = load(make_job(tmp_path, "in.jsonl"))
    other = elsewhere(tmp_path)
    before = snapshot(other)
    link = tmp_path / "out" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    is_dir = name in ("_locks", "_partial")
    link.symlink_to(other if is_dir else other / "part-00000.json", target_is_directory=is_dir)
    with pytest.raises(JobError, match=rf"out/{name} is a symlink, which batchgen never"):
        run(job)
    assert snapshot(other) == before
    assert os.path.islink(link)  # not ours to remove either
    link.unlink()
    assert run(job).complete
    assert read_output("out")["id"].to_list() == [r["id"] for r in rows(30)]


def test_plan_lock_and_piece_code_never_follows_links(tmp_path):
    # Defence in depth, for links planted after the run's start check.
    from batchgen.io import locks, pieces
    from batchgen.io.shard_plan import read_plan
    from batchgen.io.writer import Batch, ShardLayout

    out = tmp_path / "out"
    out.mkdir()
    other = elsewhere(tmp_path)
    (other / "x.lock").write_text(json.dumps(locks.holder_record("shard")))
    before = snapshot(other)
    (out / "_plan.json").symlink_to(other / "part-00000.json")
    assert read_plan(str(out)) is None
    for sub in ("_locks", "_partial"):
        (out / sub).symlink_to(other, target_is_directory=True)
    assert locks.list_locks(str(out)) == []
    assert pieces.list_pieces(str(out), "f") == {}
    pieces.remove_pieces(str(out), 0)
    pieces.remove_superseded(str(out), {0, 1})
    assert manifest.remove_stray_temps(str(out), lambda k: True, now=1e12) == []
    with pytest.raises(JobError, match="_locks is a symlink"):
        locks.try_acquire(locks.lock_path(str(out), "part-00000.lock"), "shard")
    with pytest.raises(JobError, match="_partial is a symlink"):
        pieces.commit_piece(str(out), 0, Batch([0], lines=[{}]), ShardLayout(), {})
    assert snapshot(other) == before
