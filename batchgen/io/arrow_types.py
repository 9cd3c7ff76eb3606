"""Passthrough column types: one Arrow type per column for the whole job, from one input scan.

A JSONL column's values are inferred block by block (pyarrow's own inference: ints int64,
ints mixed with floats float64, booleans, objects structs, arrays lists) and the blocks' types
merged; a Parquet column starts from its footer's type. A column whose values mix kinds that
no one type holds (a number and a string, an object and a list, ...) is MIXED: written as
text, strings unchanged and every other value as its JSON text. A column with no value at all
is written as (null) strings.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

MIXED = "mixed"  # the marker of a column written as text
ColumnType = pa.DataType | str  # an Arrow type, or MIXED


def infer(values: list[Any]) -> ColumnType:
    """The Arrow type of one block of Python values (as json.loads gives them), or MIXED."""
    try:
        return normalize(pa.array(values, from_pandas=False).type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
        return MIXED


def normalize(t: pa.DataType) -> ColumnType:
    """One spelling per kind: large strings/lists as plain ones, dictionaries as their values,
    and MIXED for a struct without fields (Parquet cannot write one)."""
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_dictionary(t):
        return normalize(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        inner = normalize(t.value_type)
        return MIXED if inner == MIXED else pa.list_(inner)
    if pa.types.is_fixed_size_list(t):
        inner = normalize(t.value_type)
        return MIXED if inner == MIXED else pa.list_(inner)
    if pa.types.is_struct(t):
        if t.num_fields == 0:
            return MIXED
        fields = []
        for f in t:
            inner = normalize(f.type)
            if inner == MIXED:
                return MIXED
            fields.append(pa.field(f.name, inner))
        return pa.struct(fields)
    return t


def merge(a: ColumnType, b: ColumnType) -> ColumnType:
    """The one type that holds values of both types, or MIXED."""
    if a == MIXED or b == MIXED:
        return MIXED
    if a == b:
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    if _is_number(a) and _is_number(b):
        if pa.types.is_floating(a) or pa.types.is_floating(b):
            return pa.float64()
        if pa.types.is_signed_integer(a) and pa.types.is_signed_integer(b):
            return pa.int64()
        return MIXED  # signed with unsigned: no int64 holds every uint64
    if pa.types.is_list(a) and pa.types.is_list(b):
        inner = merge(a.value_type, b.value_type)
        return MIXED if inner == MIXED else pa.list_(inner)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        fields: dict[str, ColumnType] = {f.name: f.type for f in a}
        for f in b:
            fields[f.name] = merge(fields[f.name], f.type) if f.name in fields else f.type
            if fields[f.name] == MIXED:
                return MIXED
        return pa.struct([pa.field(n, t) for n, t in fields.items()])
    return MIXED


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def final(t: ColumnType) -> ColumnType:
    """The type a column is written with: a column that only ever held nulls is text."""
    return pa.string() if t != MIXED and pa.types.is_null(t) else t


def kind_of_value(value: Any) -> str | None:
    """A JSON value's kind, for messages (None for null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "list"}.get(type(value), type(value).__name__)


def kind_of_type(t: pa.DataType) -> str | None:
    """The kind of value an Arrow type holds, for messages (None for null)."""
    if pa.types.is_null(t):
        return None
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_struct(t):
        return "object"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list"
    return str(t)


class ColumnTypes:
    """Accumulates the types of the passthrough columns over a scan, block by block, and
    where each kind of value was first seen (the same however the values are blocked)."""

    def __init__(self, columns: Iterable[str]):
        self.types: dict[str, ColumnType] = {c: pa.null() for c in columns}
        self.origins: dict[str, dict[str, str]] = {c: {} for c in self.types}

    def add_values(self, column: str, values: list[Any], origin: str) -> None:
        t = infer(values)
        if t == MIXED:
            for kind in dict.fromkeys(map(kind_of_value, values)):
                if kind is not None:
                    self.origins[column].setdefault(kind, origin)
            self.types[column] = MIXED
        else:
            self.add_type(column, t, origin)

    def add_type(self, column: str, t: ColumnType, origin: str) -> None:
        if t != MIXED:
            t = normalize(t)
            kind = kind_of_type(t) if t != MIXED else None
            if kind is not None:
                self.origins[column].setdefault(kind, origin)
        self.types[column] = merge(self.types[column], t)

    def result(self) -> dict[str, ColumnType]:
        return {c: final(t) for c, t in self.types.items()}


def describe(t: ColumnType) -> str:
    return "text (mixed kinds, JSON text)" if t == MIXED else str(t)


def to_json(types: dict[str, ColumnType]) -> list[dict[str, Any]]:
    """Column types as plan records: [{name, type (readable), arrow (base64 IPC schema)}]."""
    out = []
    for name, t in types.items():
        rec: dict[str, Any] = {"name": name, "type": describe(t)}
        if t != MIXED:
            schema = pa.schema([pa.field(name, t)])
            rec["arrow"] = base64.b64encode(schema.serialize().to_pybytes()).decode()
        out.append(rec)
    return out


def from_json(records: list[dict[str, Any]]) -> dict[str, ColumnType]:
    out: dict[str, ColumnType] = {}
    for rec in records:
        if "arrow" in rec:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(rec["arrow"])))
            out[rec["name"]] = schema.field(0).type
        else:
            out[rec["name"]] = MIXED
    return out


def as_text(value: Any) -> str | None:
    """A MIXED column's value: strings unchanged, anything else as its JSON text."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def column_array(values: list[Any], t: ColumnType) -> pa.Array:
    """One shard's values of a passthrough column, as the job's type fixes it."""
    if t == MIXED:
        return pa.array([as_text(v) for v in values], type=pa.string())
    return pa.array(values, type=t)
