"""`batchgen run-batch`: the same output as the job written as YAML, one file in input order,
the errors file, and a resume after SIGKILL that redoes no committed shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from kill_cycle import ENV
from workspace import TEMPLATE, rows, write_jsonl, write_parquet

# polars reads the Parquet these tests check; the GPU machine has none and runs no test here.
pl = pytest.importorskip("polars", reason="polars (a runtime dependency) is not installed")

from batchgen import cli  # noqa: E402

ENGINE = ["--max-model-len", "256", "--dtype", "float32", "--set", "model.num_kv_blocks=256"]
MESSAGES = "the committee measured the river"


def batch_lines(n: int) -> list[dict]:
    """Chat and completion requests, plus one refused and one malformed line."""
    lines = []
    for i in range(n):
        if i % 3:
            body = {"messages": [{"role": "user", "content": f"{MESSAGES} {i}"}], "max_tokens": 5}
            lines.append({"custom_id": f"c{i}", "url": "/v1/chat/completions", "body": body})
        else:
            body = {"prompt": f"document {i} says", "max_tokens": 4, "logprobs": 1}
            lines.append({"custom_id": f"c{i}", "url": "/v1/completions", "body": body})
    lines[1]["body"]["tools"] = [{"type": "function", "function": {"name": "f"}}]
    lines[2]["url"] = "/v1/embeddings"
    return lines


def read_lines(path: Path) -> list[dict]:
    out = [json.loads(x) for x in path.read_text().splitlines()]
    for line in out:  # the one field that depends on when the run happened
        if line["response"] is not None:
            line["response"]["body"].pop("created")
    return out


def invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def yaml_job(root: Path, model: str, input_path: str, **sections) -> Path:
    job = {
        "model": {"path": model, "max_model_len": 256, "dtype": "float32", "num_kv_blocks": 256},
        "input": {"path": input_path},
        "output": {"path": "yaml-out", **sections.pop("output", {})},
        **sections,
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_openai_file_equals_the_yaml_job(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", batch_lines(12))
    res = invoke("run-batch", "-i", "in.jsonl", "-o", "res.jsonl", "--model", model, *ENGINE)
    assert res.exit_code == 0, res.output
    assert "wrote res.jsonl; 2 request error(s) also in res.errors.jsonl" in res.output
    job = yaml_job(tmp_path, model, "in.jsonl", output={"format": "openai-batch"})
    assert invoke("run", str(job)).exit_code == 0
    got = read_lines(tmp_path / "res.jsonl")
    assert got == read_lines(tmp_path / "yaml-out" / "part-00000.jsonl")
    assert [x["custom_id"] for x in got] == [f"c{i}" for i in range(12)]
    errors = read_lines(tmp_path / "res.errors.jsonl")
    assert errors == [x for x in got if x["error"] is not None]
    assert [e["error"]["code"] for e in errors] == ["unsupported_field", "bad_params"]
    # A rerun finds every shard done and writes the same file again.
    again = invoke("run-batch", "-i", "in.jsonl", "-o", "res.jsonl", "--model", model, *ENGINE)
    assert "already done: 1" in again.output and read_lines(tmp_path / "res.jsonl") == got


def test_parquet_input_with_a_template(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    monkeypatch.chdir(tmp_path)
    write_parquet(tmp_path / "docs.parquet", rows(30))
    args = ["-i", "docs.parquet", "--model", model, "--prompt-template", TEMPLATE, *ENGINE]
    args += ["--set", "sampling.max_tokens=4", "--set", "output.shard_rows=7"]
    assert invoke("run-batch", *args, "-o", "res.parquet").exit_code == 0
    job = yaml_job(
        tmp_path,
        model,
        "docs.parquet",
        prompt={"template": TEMPLATE},
        sampling={"max_tokens": 4},
        output={"shard_rows": 7},
    )
    assert invoke("run", str(job)).exit_code == 0
    parts = sorted((tmp_path / "yaml-out").glob("part-*.parquet"))
    assert len(parts) == 5
    expected = pl.concat([pl.read_parquet(p) for p in parts])
    got = pl.read_parquet(tmp_path / "res.parquet")
    assert got.equals(expected) and got["id"].to_list() == [r["id"] for r in rows(30)]
    # The same rows as OpenAI batch lines (text completions keyed by id).
    assert invoke("run-batch", *args, "-o", "res.jsonl").exit_code == 0
    lines = read_lines(tmp_path / "res.jsonl")
    texts = [x["response"]["body"]["choices"][0]["text"] for x in lines]
    assert texts == got["text"].to_list()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-template", "{text}", "--prompt-column", "text"], "not both"),
        ([], "holds no OpenAI batch requests (lines with custom_id"),
        (["--chat"], "--chat needs --prompt-template"),
        (["--set", "model.nope=1"], "model.nope: unknown key"),
    ],
)
def test_bad_command_lines_exit_2(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", rows(3))
    (tmp_path / "m").mkdir()
    res = invoke("run-batch", "-i", "in.jsonl", "-o", "o.jsonl", "--model", "m", *extra)
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "o.jsonl").exists()


def entries(parts: Path) -> dict[str, int]:
    try:
        names = [n for n in os.listdir(parts / "_manifest") if not n.startswith(".")]
    except FileNotFoundError:
        return {}
    return {n: (parts / "_manifest" / n).stat().st_mtime_ns for n in names}


@pytest.mark.slow  # two subprocess runs; `make test` (-m "not gpu") runs it
def test_resumes_after_sigkill(tmp_path, monkeypatch, tiny_model_dir):
    model = tiny_model_dir("llama")
    write_jsonl(tmp_path / "in.jsonl", batch_lines(60))
    args = ["run-batch", "-i", "in.jsonl", "--model", model, *ENGINE]
    args += ["--set", "output.shard_rows=5", "--no-progress"]
    monkeypatch.chdir(tmp_path)
    assert invoke(*args, "-o", "reference.jsonl").exit_code == 0

    cmd = [sys.executable, "-m", "batchgen", *args, "-o", "res.jsonl"]
    parts = tmp_path / "res.jsonl.parts"
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 240
    while len(entries(parts)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    before = entries(parts)
    assert 2 <= len(before) < 12, "the kill must land mid-run (12 shards)"
    assert not (tmp_path / "res.jsonl").exists()  # written only when every shard is done

    rerun = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"already done: {len(before)}" in rerun.stdout
    after = entries(parts)
    assert {n: after[n] for n in before} == before  # committed shards were not redone
    assert read_lines(tmp_path / "res.jsonl") == read_lines(tmp_path / "reference.jsonl")
    assert read_lines(tmp_path / "res.errors.jsonl") == read_lines(
        tmp_path / "reference.errors.jsonl"
    )
