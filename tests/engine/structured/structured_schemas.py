"""Five JSON schemas covering the features structured output must enforce, each with the
max_tokens its outputs need on the tiny models (tokens are about one character there)."""

SCHEMAS = {
    # nested object, required and optional fields, strings with a pattern and a length bound
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 4},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["zip"],
                "additionalProperties": False,
            },
            "nickname": {"type": "string", "maxLength": 3},
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    # array of objects with minItems, enum
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["items", "status"],
        "additionalProperties": False,
    },
    # numbers with bounds (exclusive too), enum, boolean, anyOf with null
    "reading": {
        "type": "object",
        "properties": {
            "value": {"type": "number", "minimum": -10, "maximum": 10},
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
            "unit": {"type": "string", "enum": ["C", "F", "K"]},
            "ok": {"type": "boolean"},
            "tag": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        },
        "required": ["value", "level", "unit", "ok"],
        "additionalProperties": False,
    },
    # anyOf over object shapes, date pattern
    "event": {
        "type": "object",
        "properties": {
            "kind": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["a"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"b": {"enum": ["x", "y"]}},
                        "required": ["b"],
                        "additionalProperties": False,
                    },
                ]
            },
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        },
        "required": ["kind", "date"],
        "additionalProperties": False,
    },
    # array of enums with minItems, a bounded count
    "tags": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
            },
            "count": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["tags", "count"],
        "additionalProperties": False,
    },
}

# Longest outputs seen on the tiny llama with these schemas: 88, 116, 82, 40, 44 tokens.
MAX_TOKENS = {"person": 112, "order": 144, "reading": 112, "event": 64, "tags": 64}
