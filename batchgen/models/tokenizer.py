"""Tokenizer: a Hugging Face tokenizer.json plus the special tokens and chat template around it."""

from __future__ import annotations

import os

from tokenizers import Tokenizer as HFTokenizer

from batchgen.models.config import read_json_object
from batchgen.models.errors import ModelLoadError


def _token_content(value: object) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Fast tokenizer from `tokenizer.json`, special tokens from `tokenizer_config.json`.

    Attributes:
        vocab_size: size of the tokenizer's vocabulary (including added tokens).
        eos_token_ids: ids that end generation (config.json / generation_config.json EOS ids
            are merged in by the engine).
        bos_token_id, bos_token, eos_token: special tokens, or None.
        chat_template: the jinja2 chat template string, or None.
    """

    def __init__(self, tokenizer: HFTokenizer, config: dict | None = None) -> None:
        config = config or {}
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: frozenset[int] = frozenset([eos_id] if eos_id is not None else [])
        template = config.get("chat_template")
        if isinstance(template, list):  # the named-template form: [{"name", "template"}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template if isinstance(template, str) else None

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """Load `path/tokenizer.json` (required), `tokenizer_config.json` and a sibling
        `chat_template.jinja` (optional)."""
        tok_path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise ModelLoadError(
                f"{tok_path}: missing tokenizer.json — batchgen needs a fast (tokenizers) "
                "tokenizer file in the model directory"
            )
        try:
            tokenizer = HFTokenizer.from_file(tok_path)
        except Exception as e:  # the tokenizers library raises plain Exception subclasses
            raise ModelLoadError(
                f"{tok_path}: cannot be read by the tokenizers library ({e})"
            ) from e
        config: dict = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_path):
            config = read_json_object(config_path)
        jinja_path = os.path.join(path, "chat_template.jinja")
        if "chat_template" not in config and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                config["chat_template"] = f.read()
        return cls(tokenizer, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
