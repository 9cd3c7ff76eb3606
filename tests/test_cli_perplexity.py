"""`batchgen perplexity MODEL TEXTFILE`: the number LLM.perplexity gives, JSON, clear errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchgen import LLM, cli

TEXT = "The river measured a rainfall record on Monday. " * 12


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def test_perplexity_command(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "ppl.json"
    res = invoke("perplexity", model, text, "--context", 32, "--stride", 8, "--json", out)
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    llm = LLM(model, dtype="auto", device="cpu", max_model_len=32)
    (expected,) = llm.perplexity([TEXT], context=32, stride=8, use_tqdm=False)
    assert record["num_tokens"] == expected.num_tokens
    assert record["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert f"perplexity {expected.perplexity:.4f} over {expected.num_tokens} tokens" in res.output


def test_perplexity_command_errors(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    res = invoke("perplexity", model, text, "--context", 16, "--stride", 32)
    assert res.exit_code == 2 and "stride=32: must be between 1 and context=16" in res.output
    res = invoke("perplexity", model, tmp_path / "missing.txt")
    assert res.exit_code == 2 and "missing.txt" in res.output
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe text")
    res = invoke("perplexity", model, tmp_path / "bad.txt", "--context", 16, "--stride", 8)
    assert res.exit_code == 2 and "bad.txt" in res.output
    (tmp_path / "one.txt").write_text("", encoding="utf-8")
    res = invoke("perplexity", model, tmp_path / "one.txt", "--context", 16, "--stride", 8)
    assert res.exit_code == 2 and "nothing to score" in res.output
    res = invoke("perplexity", model, text, "--context", 10**6, "--stride", 8)
    assert res.exit_code == 2 and "max_model_len" in res.output
