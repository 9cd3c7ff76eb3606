"""repr() of user values for error messages, bounded in size: a job file of a few hundred bytes
can hold YAML aliases that expand to millions of items, and the message must not."""

from __future__ import annotations

import reprlib

MAX_CHARS = 200
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 120
_REPR.maxother = 120
for _name in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset"):
    setattr(_REPR, _name, 6)


def short_repr(value: object) -> str:
    """repr(value), with long strings and long or deep containers cut ("..."), and at most
    MAX_CHARS characters in all."""
    text = _REPR.repr(value)
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."
