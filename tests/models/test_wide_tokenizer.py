"""The wide BPE tokenizer: exactly the asked vocabulary, any UTF-8 text round-trips, seeded,
and `make_model(vocab_size=...)` writes a model around it."""

from __future__ import annotations

import json

import pytest

from batchgen.models.make_model import make_model
from batchgen.models.tiny_tokenizer import BOS, EOS
from batchgen.models.tokenizer import Tokenizer
from batchgen.models.wide_tokenizer import wide_bpe_tokenizer

TEXT = '{"name": "Ann Lee", "tags": ["a","b"]}\n\tHéllo 日本語 ✓ 2026 — \x00 ok'


@pytest.fixture(scope="module")
def wide():
    return wide_bpe_tokenizer(20000)


def test_exact_size_special_ids_and_round_trip(wide):
    assert wide.get_vocab_size() == 20000
    vocab = wide.get_vocab()
    assert sorted(vocab.values()) == list(range(20000))
    assert (vocab[BOS], vocab[EOS]) == (0, 1)
    ids = wide.encode(TEXT, add_special_tokens=False).ids
    assert wide.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges apply: fewer tokens than bytes
    assert wide.encode("x").ids[0] == vocab[BOS]  # BOS prepended, as the tiny models'


def test_vocabulary_looks_like_a_real_one(wide):
    strings = [wide.decode([i]) for i in range(261, 20000)]
    assert sum(s.startswith(" ") for s in strings) > 0.3 * len(strings)
    assert any(s == '":' for s in strings) and any(s.isdigit() for s in strings)
    assert any(any(ord(c) > 0x3000 for c in s) for s in strings)  # multi-byte characters


def test_seeded(wide):
    assert wide_bpe_tokenizer(20000).to_str() == wide.to_str()
    assert wide_bpe_tokenizer(20000, seed=1).to_str() != wide.to_str()
    with pytest.raises(ValueError, match="must exceed"):
        wide_bpe_tokenizer(261)


def test_make_model_with_a_wide_vocabulary(tmp_path):
    make_model(str(tmp_path), "qwen3", vocab_size=4096)
    config = json.loads((tmp_path / "config.json").read_text())
    tok = Tokenizer.from_dir(str(tmp_path))
    assert config["vocab_size"] == tok.vocab_size == 4096
    assert tok.eos_token_ids == frozenset([config["eos_token_id"]])
    assert tok.decode(tok.encode(TEXT)) == TEXT
