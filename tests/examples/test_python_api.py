"""examples/python_api.py runs on the tiny model and prints what the API returns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from batchgen import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "python_api.py"


def sections(output: str) -> dict[str, list[str]]:
    """The script's output by section: {"generate: greedy": [lines], ...}."""
    found: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("== "):
            current = found.setdefault(line[3:], [])
        elif current is not None:
            current.append(line)
    return found


def test_python_api_example(tiny_model_dir):
    model = tiny_model_dir("llama")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), model],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=600,  # a hang detector; a few seconds on the CPU
    )
    assert result.returncode == 0, result.stderr
    got = sections(result.stdout)
    assert list(got) == [
        "generate: greedy",
        "generate: sampled, n=3",
        "generate: one bad request among good ones",
        "score",
        "stream: results as each request finishes",
    ], result.stdout

    # What the script printed is what the API returns for the same calls here.
    llm = LLM(model, dtype="auto")
    prompts = [
        "The city council met on Monday to discuss",
        "Once upon a time, in a small village,",
        "The recipe calls for two cups of flour and",
    ]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert got["generate: greedy"] == [
        f"[{i}] {o.text!r} finish={o.finish_reason} prompt_tokens={len(o.prompt_token_ids)}"
        f" output_tokens={len(o.token_ids)}"
        for i, o in enumerate(greedy)
    ]
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=12, seed=1234)
    (out,) = llm.generate(prompts[:1], sampled, use_tqdm=False)
    assert got["generate: sampled, n=3"] == [
        f"sample {s.index}: {s.text!r} finish={s.finish_reason}" for s in out.outputs
    ]
    assert len(out.outputs) == 3

    good, bad = got["generate: one bad request among good ones"]
    assert good == "finish=length error=None"
    assert bad.startswith("finish=error error=") and "empty" in bad

    (scores,) = llm.score(
        ["Question: What is the capital of France?\nAnswer:"],
        [["Paris", "Lyon", "a bowl of soup"]],
        separator=" ",
        use_tqdm=False,
    )
    assert got["score"] == [
        f"{c!r}: score={s.score:.4f} tokens={s.num_tokens} mean={s.mean:.4f}"
        for c, s in zip(["Paris", "Lyon", "a bowl of soup"], scores)
    ]
    assert all(s.error is None and s.score < 0 and s.num_tokens > 0 for s in scores)

    # Streaming: each request is printed once, as it finishes, shortest max_tokens first, in
    # steps that come one after another (not all at the end).
    lines = got["stream: results as each request finishes"]
    finished = [line.split() for line in lines]  # ["step", "N:", "req-i", "done,", "T", ...]
    assert [f[2] for f in finished] == ["req-1", "req-2", "req-0"], lines
    assert [int(f[4]) for f in finished] == [4, 8, 16], lines
    steps = [int(f[1].rstrip(":")) for f in finished]
    assert steps == sorted(steps) and len(set(steps)) == 3, lines
