"""StructuredOutputsParams: exactly one constraint, its shape checked, one key per content."""

from __future__ import annotations

import pytest

from batchgen import SamplingParams
from batchgen.sampling_params import SamplingParamsError
from batchgen.structured_outputs import StructuredOutputsError, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}


def test_a_schema_as_dict_or_text_is_one_constraint():
    a = StructuredOutputsParams(json=SCHEMA)
    b = StructuredOutputsParams(json='{"properties": {"b": {"type": "string"}, "a": {"type": '
                                '"integer"}}, "type": "object"}')  # fmt: skip
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert a.kind == "json" and a.is_json and b.json == SCHEMA
    assert StructuredOutputsParams(json={"type": "string"}) != a


@pytest.mark.parametrize(
    "value",
    [
        {"json": SCHEMA},
        {"json_object": True},
        {"regex": "[a-z]+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a"'},
    ],
)
def test_each_kind_round_trips_through_a_dict(value):
    params = StructuredOutputsParams.from_value(value)
    assert params.to_dict() == value
    assert StructuredOutputsParams.from_value(params) is params
    assert SamplingParams(structured_outputs=value).structured_outputs == params
    assert params.is_json == (params.kind in ("json", "json_object"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "give exactly one of json, json_object, regex, choice, grammar \\(got none\\)"),
        ({"json": SCHEMA, "regex": "a"}, "\\(got json, regex\\)"),
        ({"jsn": SCHEMA}, "structured_outputs.jsn: unknown key"),
        ({"json": 3}, "structured_outputs.json=3: a JSON schema must be an object"),
        ({"json": "{not json"}, "structured_outputs.json: the schema is not JSON text"),
        ({"json": {"a": float("nan")}}, "structured_outputs.json: the schema is not plain JSON"),
        ({"json_object": False}, "json_object=False: must be true"),
        ({"regex": "  "}, "regex='  ': must be a non-empty string"),
        ({"choice": "yes"}, "choice='yes': must be a list of strings"),
        ({"choice": []}, "choice=\\[\\]: must be a non-empty list"),
        ({"choice": ["a", 1]}, "must be a non-empty list of non-empty strings"),
        ({"grammar": 7}, "grammar=7: must be a non-empty string"),
        ("json", "expected a mapping"),
    ],
)
def test_bad_shapes_name_the_key(value, message):
    with pytest.raises(StructuredOutputsError, match=message):
        StructuredOutputsParams.from_value(value)
    with pytest.raises(SamplingParamsError, match="SamplingParams.structured_outputs") as e:
        SamplingParams(structured_outputs=value)
    assert e.value.field == "structured_outputs"


def test_settings_that_contradict_a_constraint_are_refused():
    with pytest.raises(SamplingParamsError, match="ignore_eos=True: cannot be set with"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    with pytest.raises(SamplingParamsError, match="min_tokens=3: cannot be set with"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})
