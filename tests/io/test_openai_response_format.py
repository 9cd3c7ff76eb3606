"""OpenAI response_format -> structured_outputs, and the result is a valid SamplingParams field."""

from __future__ import annotations

import pytest

from batchgen import SamplingParams
from batchgen.io.openai_response_format import structured_outputs_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"json_object": True}),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
            {"json": SCHEMA},
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, {"json": SCHEMA}),
        ({"type": "json_schema", "json_schema": {"name": "any"}}, {"json": {}}),
    ],
)
def test_mapping(response_format, expected):
    got = structured_outputs_of(response_format)
    assert got == expected
    if got is not None:  # what the planner will pass on is a valid constraint
        assert SamplingParams(structured_outputs=got).structured_outputs.to_dict() == got


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ("json", r"body.response_format='json': expected an object"),
        ({"type": "xml"}, r"body.response_format.type='xml': expected 'text'"),
        ({}, r"body.response_format.type=None"),
        ({"type": "json_schema"}, r"body.response_format.json_schema=None: expected an object"),
        (
            {"type": "json_schema", "json_schema": {"schema": [1]}},
            r"body.response_format.json_schema.schema=\[1\]: expected an object",
        ),
    ],
)
def test_bad_response_format_names_the_key(response_format, message):
    with pytest.raises(ValueError, match=message):
        structured_outputs_of(response_format)
