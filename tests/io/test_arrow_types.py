"""Passthrough column types: inference per block, merging, the text fallback, round trips."""

from __future__ import annotations

import pyarrow as pa

from batchgen.io.arrow_types import (
    MIXED,
    ColumnTypes,
    column_array,
    from_json,
    infer,
    merge,
    to_json,
)


def test_infer_kinds():
    assert infer([1, 2, None]) == pa.int64()
    assert infer([1, 2.5]) == pa.float64()
    assert infer([True, None]) == pa.bool_()
    assert infer([{"a": 1}, {"b": "x"}]) == pa.struct([("a", pa.int64()), ("b", pa.string())])
    assert infer([["a"], [], None]) == pa.list_(pa.string())
    assert infer([1, "x"]) == MIXED
    assert infer([True, 1]) == MIXED
    assert infer([[1], ["a"]]) == MIXED
    assert infer([{}]) == MIXED  # Parquet has no struct without fields
    assert infer([2**63]) == MIXED  # no int64 holds it
    assert infer([None]) == pa.null()


def test_merge_across_blocks():
    assert merge(pa.int64(), pa.float64()) == pa.float64()
    assert merge(pa.null(), pa.bool_()) == pa.bool_()
    assert merge(pa.int32(), pa.int64()) == pa.int64()
    assert merge(pa.list_(pa.int64()), pa.list_(pa.float64())) == pa.list_(pa.float64())
    a = pa.struct([("x", pa.int64())])
    b = pa.struct([("y", pa.string()), ("x", pa.float64())])
    assert merge(a, b) == pa.struct([("x", pa.float64()), ("y", pa.string())])
    assert merge(pa.int64(), pa.string()) == MIXED
    assert merge(pa.struct([("x", pa.int64())]), pa.struct([("x", pa.string())])) == MIXED
    assert merge(pa.int64(), pa.uint64()) == MIXED
    assert merge(MIXED, pa.int64()) == MIXED


def test_column_types_over_blocks_and_all_null_is_text():
    types = ColumnTypes(["n", "none", "m"])
    types.add_values("n", [1, None], "a")
    types.add_values("n", [2.5], "b")
    types.add_values("none", [None, None], "a")
    types.add_values("m", [1], "a")
    types.add_values("m", ["x"], "b")
    assert types.result() == {"n": pa.float64(), "none": pa.string(), "m": MIXED}
    assert types.origins["m"] == {"number": "a", "string": "b"}
    # Where each kind was first seen does not depend on how the values were blocked.
    one = ColumnTypes(["m"])
    one.add_values("m", [1, 2.5, None, "x", {"k": 1}], "f")
    split = ColumnTypes(["m"])
    for block in ([1], [2.5, None], ["x"], [{"k": 1}]):
        split.add_values("m", block, "f")
    assert one.origins == split.origins == {"m": {"number": "f", "string": "f", "object": "f"}}


def test_json_round_trip_and_arrays():
    types = {"s": pa.struct([("a", pa.list_(pa.int64()))]), "m": MIXED, "f": pa.float64()}
    assert from_json(to_json(types)) == types
    arr = column_array([{"a": [1]}, None, {"a": None}], types["s"])
    assert arr.type == types["s"] and arr.to_pylist() == [{"a": [1]}, None, {"a": None}]
    assert column_array([1, 2], pa.float64()).to_pylist() == [1.0, 2.0]
    text = column_array(["x", 7, {"k": [1, True]}, None], MIXED)
    assert text.to_pylist() == ["x", "7", '{"k": [1, true]}', None]
