"""Tokenizer: a Hugging Face tokenizer.json plus the special tokens and chat template around it."""

from __future__ import annotations

import functools
import os
import re

from tokenizers import Tokenizer as HFTokenizer

from batchgen.models.config import read_json_object
from batchgen.models.errors import ModelLoadError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a BPE vocabulary writes for each
    byte -> that byte (printable bytes stand for themselves, the rest are shifted past 255)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


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

    def to_json(self) -> str:
        """The tokenizer in tokenizer.json form (what the grammar engine indexes)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character).

        Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) map through their byte alphabet;
        SentencePiece ones write `<0xNN>` byte tokens and `▁` for a space; added tokens are their
        own text.
        """
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self._tok.decoder).__name__ == "ByteLevel":
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
