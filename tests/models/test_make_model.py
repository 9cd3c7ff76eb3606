"""`make_model` writes deterministic, complete HF-format directories."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

from batchgen.models.errors import ModelLoadError
from batchgen.models.make_model import make_model
from batchgen.models.tokenizer import Tokenizer


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    make_model(str(tmp_path / "a"), "qwen3", seed=3)
    make_model(str(tmp_path / "b"), "qwen3", seed=3)
    make_model(str(tmp_path / "c"), "qwen3", seed=4)
    a, b, c = (load_file(str(tmp_path / x / "model.safetensors")) for x in "abc")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_directory_contents_and_tokenizer(tiny_model_dir):
    path = tiny_model_dir("llama")
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert os.path.isfile(os.path.join(path, name)), name
    config = json.load(open(os.path.join(path, "config.json")))
    tok = Tokenizer.from_dir(path)
    assert config["vocab_size"] >= tok.vocab_size
    text = "Héllo, the committee measured 2026 ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text  # byte-level: any UTF-8 text round-trips
    assert tok.chat_template and "messages" in tok.chat_template
    assert tok.eos_token_ids == frozenset([config["eos_token_id"]])


def test_unknown_arch_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="arch 'gpt2'"):
        make_model(str(tmp_path), "gpt2")
