"""Hub model ids resolved through a hand-built hub cache with HF_HUB_OFFLINE=1 (no network)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchgen.job import JobError, load_job
from batchgen.models.errors import ModelLoadError
from batchgen.models.hub import is_repo_id, resolve_model
from batchgen.pipeline.fingerprint import fingerprint_parts
from batchgen.pipeline.model_source import resolve_job_model

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(
    cache: Path, model_dir: str, repo_id: str = REPO_ID, ref: str = "main", commit: str = COMMIT
) -> Path:
    """The hub cache layout (huggingface_hub's documented one): models--ORG--NAME/refs/<ref>
    holds the commit, snapshots/<commit>/ the files (blobs/ is optional)."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot, dirs_exist_ok=True)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache under tmp_path, offline, for this process and its children."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads both when first imported: this process imported it already.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_repo_id_shape():
    assert is_repo_id("Qwen/Qwen3-0.6B") and is_repo_id("meta-llama/Llama-3.2-1B-Instruct")
    for text in ("./a/b", "/a/b", "a/b/c", "gpt2", "~/x", "a--b/c", "a/..", "a/b.git", "a/"):
        assert not is_repo_id(text), text


def test_cached_repo_id_resolves_offline(offline_cache, tiny_model_dir):
    snapshot = populate_cache(offline_cache, tiny_model_dir("llama"))
    assert resolve_model(REPO_ID) == str(snapshot)


def test_revision_picks_its_ref(offline_cache, tiny_model_dir):
    populate_cache(offline_cache, tiny_model_dir("llama"))
    other = populate_cache(offline_cache, tiny_model_dir("qwen2"), ref="v2", commit="f" * 40)
    assert resolve_model(REPO_ID, revision="v2") == str(other)
    assert resolve_model(REPO_ID, revision="f" * 40) == str(other)


def test_local_directory_wins_over_repo_id(offline_cache, tiny_model_dir, tmp_path, monkeypatch):
    populate_cache(offline_cache, tiny_model_dir("qwen2"))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("llama"), tmp_path / REPO_ID)
    assert resolve_model(REPO_ID) == REPO_ID
    with pytest.raises(ModelLoadError, match="applies to hub ids only"):
        resolve_model(REPO_ID, revision="main")


def test_missing_offline_says_how_to_fetch(offline_cache):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(REPO_ID, revision="v1")
    message = str(e.value)
    assert "HF_HUB_OFFLINE is set" in message and str(offline_cache) in message
    assert f"hf download {REPO_ID} --revision v1 --include '*.safetensors' '*.json'" in message


def test_partial_snapshot_names_what_is_missing(offline_cache, tiny_model_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(Path(tiny_model_dir("llama")) / "config.json", config_only)
    populate_cache(offline_cache, str(config_only))
    with pytest.raises(ModelLoadError, match=r"has no tokenizer.json, \*.safetensors weights"):
        resolve_model(REPO_ID)


def test_not_a_directory_nor_repo_id():
    with pytest.raises(ModelLoadError, match="is not a directory.*ORG/NAME"):
        resolve_model("./no/such/model")


def test_fingerprint_does_not_depend_on_cache_location(tmp_path, monkeypatch, tiny_model_dir):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "x"}\n')
    job_file = write_job(tmp_path, REPO_ID)
    parts = []
    for where in ("cache-a", "deeper/cache-b"):
        populate_cache(tmp_path / where, tiny_model_dir("llama"))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / where))
        job = resolve_job_model(load_job(str(job_file)))
        assert job.model.path.startswith(str(tmp_path / where)) and job.model.name == REPO_ID
        parts.append(fingerprint_parts(job, ["in.jsonl"]))
    assert parts[0] == parts[1]


def write_job(root: Path, model: str, **model_keys) -> Path:
    job = {
        "model": {
            "path": model,
            "dtype": "float32",
            "max_model_len": 128,
            "num_kv_blocks": 64,
            **model_keys,
        },
        "input": {"path": "in.jsonl"},
        "prompt": {"template": "Summarize: {text}"},
        "sampling": {"max_tokens": 4, "temperature": 0.0},
        "output": {"path": "out", "shard_rows": 10},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def cli(cwd: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "batchgen", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_validate_and_run_with_a_cached_repo_id(offline_cache, tiny_model_dir, tmp_path):
    populate_cache(offline_cache, tiny_model_dir("llama"))
    rows = [{"id": f"r{i}", "text": f"document {i}"} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = write_job(tmp_path, REPO_ID, revision="main")
    checked = cli(tmp_path, offline_cache, "validate", str(job))
    assert checked.returncode == 0, checked.stderr
    assert "12 rows: 12 ok" in checked.stdout
    ran = cli(tmp_path, offline_cache, "run", str(job), "--no-progress")
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "out" / "_SUCCESS").exists()


def test_cli_without_the_model_is_one_clear_error(offline_cache, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "x"}\n')
    job = write_job(tmp_path, REPO_ID)
    for command in ("validate", "run"):
        res = cli(tmp_path, offline_cache, command, str(job))
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")
        assert f"model.path: '{REPO_ID}' is not a local directory, nor in the hub cache" in lines[0]
        assert f"`hf download {REPO_ID} --include" in lines[0]


def test_llm_accepts_a_cached_repo_id(offline_cache, tiny_model_dir):
    from batchgen import LLM, SamplingParams

    populate_cache(offline_cache, tiny_model_dir("llama"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    options = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 64}
    by_id = LLM(REPO_ID, revision="main", **options).generate(["hello there"], greedy, False)
    by_dir = LLM(tiny_model_dir("llama"), **options).generate(["hello there"], greedy, False)
    assert by_id[0].token_ids == by_dir[0].token_ids and len(by_id[0].token_ids) == 6


def test_job_revision_key_is_checked(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "x"}\n')
    with pytest.raises(JobError, match="model.revision: expected str"):
        load_job(str(write_job(tmp_path, REPO_ID, revision=3)))
