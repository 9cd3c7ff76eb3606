"""examples/openai_batch/ runs as its README says: one OpenAI-format result per request line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "openai_batch"
OBJECTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}


def test_openai_batch_example(tmp_path, tiny_model_dir):
    requests = [json.loads(line) for line in (EXAMPLE / "requests.jsonl").read_text().splitlines()]
    assert {r["url"] for r in requests} == set(OBJECTS)  # the example mixes both endpoints
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgen", "run", "examples/openai_batch/job.yaml"]
    cmd += ["--set", f"model.path={tiny_model_dir('llama')}", "--set", f"output.path={out}"]
    result = subprocess.run(
        [*cmd, "--no-progress"],
        cwd=REPO,  # the job's input path is relative to the repository root, as documented
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,  # a hang detector; seconds on the CPU
    )
    assert result.returncode == 0, result.stderr
    assert (out / "_SUCCESS").exists()

    lines = [
        json.loads(line)
        for part in sorted(out.glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    counts = Counter(line["custom_id"] for line in lines)
    assert counts == Counter(r["custom_id"] for r in requests)  # every request exactly once
    assert set(counts.values()) == {1}
    by_id = {line["custom_id"]: line for line in lines}
    for request in requests:
        line = by_id[request["custom_id"]]
        assert line["error"] is None, line
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == OBJECTS[request["url"]]
        n = request["body"].get("n", 1)
        assert len(body["choices"]) == n  # one choice per requested sample
        most = request["body"].get("max_tokens") or request["body"].get("max_completion_tokens")
        assert 0 < body["usage"]["completion_tokens"] <= n * most
        for choice in body["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
