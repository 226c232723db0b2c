"""Limits on structured-output constraints, checked before anything compiles: sizes, enum values,
properties, nesting, and the JSON-schema keywords xgrammar accepts but cannot enforce."""

from __future__ import annotations

import json

import pytest

from tallyserve.config import EngineArgs
from tallyserve.structured_output.limits import StructuredOutputsLimits

LIMITS = StructuredOutputsLimits(compile_timeout=5.0, max_schema_bytes=10_000, max_enum_values=10, max_properties=5)


def check(schema) -> None:
    LIMITS.check("json", json.dumps(schema))


def test_defaults_come_from_engine_args():
    d = StructuredOutputsLimits.default()
    args = EngineArgs()
    assert (d.compile_timeout, d.max_schema_bytes, d.max_enum_values, d.max_properties) == (
        args.structured_outputs_compile_timeout, args.structured_outputs_max_schema_bytes,
        args.structured_outputs_max_enum_values, args.structured_outputs_max_properties)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}, "not": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "enum": list("abcdefghij")},
    {"$defs": {"x": {"type": "string"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}},
    {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/$defs/x"}], "description": "pydantic's shape"}},
     "$defs": {"x": {"type": "string"}}},
    {"anyOf": [{"type": "string"}, {"type": "integer"}]},
])
def test_ordinary_schemas_pass(schema):
    check(schema)


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "enum": [str(i) for i in range(11)]}, ["11 enum values", "--structured-outputs-max-enum-values"]),
    ({"type": "object", "properties": {f"p{i}": {"enum": [i, -i]} for i in range(6)}}, ["12 enum values"]),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6)}},
     ["6 properties", "--structured-outputs-max-properties"]),
    ({"type": "string", "description": "x" * 10_000}, ["bytes", "--structured-outputs-max-schema-bytes"]),
    ({"not": {"type": "string"}}, ["'not' at #", "cannot be enforced"]),
    ({"type": "object", "properties": {"a": {"if": {"const": 1}, "then": {"const": 2}}}},
     ["'if' at #/properties/a"]),
    ({"$ref": "https://example.com/schema.json"}, ["remote $ref", "https://example.com/schema.json"]),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ["allOf of 2 parts at #"]),
    ({"type": "object", "allOf": [{"required": ["a"]}]}, ["allOf of beside ['type']"]),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["'uniqueItems' at #"]),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["'dependentRequired'"]),
])
def test_over_a_limit_or_unenforceable_is_a_value_error_naming_it(schema, words):
    with pytest.raises(ValueError) as info:
        check(schema)
    for word in words:
        assert word in str(info.value)


def test_nesting_depth_is_bounded():
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="nests deeper than 32 levels"):
        check(schema)


def test_choices_count_against_the_enum_limit():
    LIMITS.check("choice", json.dumps(list("abcdefghij")))
    with pytest.raises(ValueError, match="11 choices"):
        LIMITS.check("choice", json.dumps(list("abcdefghijk")))


@pytest.mark.parametrize("name, value", [("structured_outputs_compile_timeout", 0),
                                         ("structured_outputs_compile_timeout", float("inf")),
                                         ("structured_outputs_max_schema_bytes", 0),
                                         ("structured_outputs_max_enum_values", -1),
                                         ("structured_outputs_max_properties", 1.5)])
def test_bad_limit_arguments_are_value_errors(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be (a positive number of seconds|an integer >= 1), got "):
        EngineArgs(**{name: value}).validate()
