"""One JSONL input line to an object, refusing what would crash a job later."""

from __future__ import annotations

import json
import re

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, accepted at the start of a file
# A JSON escape of a UTF-16 surrogate: only lines holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")


class NotText(ValueError):
    """A JSON line that parses but holds a string that is no text (a lone surrogate)."""


def loads(line: str | bytes):
    """json.loads that raises ValueError for everything a bad line can do: bytes that are not
    UTF-8 (UnicodeDecodeError), invalid JSON (a BOM included: json.loads would take one at the
    start of any bytes line; callers strip the file's own), nesting too deep for the parser
    (RecursionError), and (NotText) lone surrogate escapes ("\\ud800"), which decode but are no
    text (they cannot be encoded, tokenized or written)."""
    # Decoded here, strictly: json.loads(bytes) decodes with "surrogatepass", letting the
    # UTF-8 bytes of a surrogate through as one.
    raw = line.decode("utf-8") if isinstance(line, bytes) else line
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate_at(obj)
        if where is not None:
            raise NotText(
                f"{where} holds a lone surrogate escape (\\ud800-\\udfff), which is no text"
            )
    return obj


def _lone_surrogate_at(obj) -> str | None:
    """Where in obj a string (value or key) holds a lone surrogate, as "key 'a.b[2]'"; None if
    nowhere. Keys in the answer are escaped: the message itself must stay encodable."""
    stack = [(obj, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return f"key {path!r}" if path else "the line"
        elif isinstance(item, dict):
            for k, v in item.items():
                sub = f"{path}.{_escaped(k)}" if path else _escaped(k)
                stack += [(k, sub), (v, sub)]
        elif isinstance(item, list):
            stack += [(v, f"{path}[{i}]") for i, v in enumerate(item)]
    return None


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
