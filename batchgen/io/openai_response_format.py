"""OpenAI `response_format` (a Batch API body's output constraint) as structured_outputs."""

from __future__ import annotations

from typing import Any

from batchgen.short_repr import short_repr


def structured_outputs_of(response_format: Any, where: str = "body.response_format") -> dict | None:
    """The structured_outputs dict of an OpenAI response_format, or None for plain text.

    {"type": "text"} (or None) -> None; {"type": "json_object"} -> {"json_object": True};
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} ->
    {"json": schema}. The schema is always enforced, `strict` or not; a json_schema without a
    schema allows any JSON value (the empty schema).

    Raises:
        ValueError naming the key (under `where`) for anything else.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"{where}={short_repr(response_format)}: expected an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ValueError(
            f"{where}.type={short_repr(kind)}: expected 'text', 'json_object' or 'json_schema'"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}.json_schema={short_repr(spec)}: expected an object")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where}.json_schema.schema={short_repr(schema)}: expected an object")
    return {"json": schema}
