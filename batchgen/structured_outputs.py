"""StructuredOutputsParams: the constraint a request's output must follow (vLLM's names)."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from batchgen.short_repr import short_repr

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(ValueError):
    """A structured_outputs value of the wrong shape (not yet a grammar the library refused);
    the message names the key."""


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    Args:
        json: a JSON schema, as a dict or as JSON text; the output is one JSON value valid
            under it (written compactly: ", " between items, ": " after keys).
        json_object: True: the output is any JSON object.
        regex: the whole output matches this regular expression (Rust regex syntax, anchored).
        choice: the output is exactly one of these strings.
        grammar: a grammar in GBNF (llama.cpp, `root ::= ...`) or Lark (llguidance's EBNF).
    """

    json: dict | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise StructuredOutputsError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)} "
                f"(got {', '.join(given) or 'none'})"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            object.__setattr__(self, "json", _schema(value))
        elif kind == "json_object" and value is not True:
            raise StructuredOutputsError(
                f"structured_outputs.json_object={short_repr(value)}: must be true"
            )
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value.strip()):
            raise StructuredOutputsError(
                f"structured_outputs.{kind}={short_repr(value)}: must be a non-empty string"
            )
        elif kind == "choice":
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise StructuredOutputsError(
                    f"structured_outputs.choice={short_repr(value)}: must be a list of strings"
                )
            choices = tuple(value)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise StructuredOutputsError(
                    f"structured_outputs.choice={short_repr(value)}: must be a non-empty list "
                    "of non-empty strings"
                )
            object.__setattr__(self, "choice", choices)
        object.__setattr__(self, "_key", _canonical(kind, getattr(self, kind)))

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or a dict of its fields ({"json": {...}})."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputsError(
                f"structured_outputs={short_repr(value)}: expected a mapping with one of "
                f"{', '.join(KINDS)}"
            )
        unknown = [k for k in value if k not in KINDS]
        if unknown:
            raise StructuredOutputsError(
                f"structured_outputs.{unknown[0]}: unknown key (known: {', '.join(KINDS)})"
            )
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> str:
        """The constraint as canonical text: equal constraints (a schema as a dict or as JSON
        text, keys in any order) share one key, which keys the compiled-grammar cache."""
        return self._key  # type: ignore[attr-defined]

    @property
    def is_json(self) -> bool:
        """The output is JSON (json or json_object)."""
        return self.json is not None or self.json_object is not None

    def to_dict(self) -> dict[str, Any]:
        """{kind: value}, JSON-serialisable (what a job file or an overrides column holds)."""
        value = getattr(self, self.kind)
        return {self.kind: list(value) if isinstance(value, tuple) else value}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def _schema(value: Any) -> dict | bool:
    """A JSON schema as a dict (or the boolean schema true/false); JSON text is parsed."""
    if isinstance(value, str):
        try:
            value = jsonlib.loads(value)
        except (ValueError, RecursionError) as e:
            raise StructuredOutputsError(
                f"structured_outputs.json: the schema is not JSON text ({e})"
            ) from None
    if not isinstance(value, (dict, bool)):
        raise StructuredOutputsError(
            f"structured_outputs.json={short_repr(value)}: a JSON schema must be an object"
        )
    try:
        _canonical("json", value)
    except (TypeError, ValueError, RecursionError) as e:
        raise StructuredOutputsError(
            f"structured_outputs.json: the schema is not plain JSON data ({e})"
        ) from None
    return value


def _canonical(kind: str, value: Any) -> str:
    body = jsonlib.dumps(
        list(value) if isinstance(value, tuple) else value,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return f"{kind}:{body}"
