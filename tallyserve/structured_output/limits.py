"""Limits on structured-output constraints, checked before anything compiles.

A grammar's compile time grows fast with its size (on a 2-core CPU with a 49k-token vocabulary:
a 10,000-value enum 9 s, 30,000 values 80 s; an object of 1,000 properties 2 s, 3,000 properties
147 s), so the size of what a request may ask for is bounded, in OpenAI's spirit (1,000 enum
values, bounded properties and nesting), and every compile also has a deadline
(`compile_timeout`, enforced by the compile pool). JSON-schema keywords that xgrammar accepts
but does not enforce are refused here too: output that silently ignores the schema is worse
than a 400 naming the keyword.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator
from tallyserve.config import EngineArgs

MAX_SCHEMA_DEPTH = 32

# Keywords xgrammar 0.2.9 accepts and ignores (checked by comparing grammars with and without each).
UNSUPPORTED_KEYWORDS = {
    "not": "negated schemas",
    "if": "conditional schemas (if / then / else)",
    "then": "conditional schemas (if / then / else)",
    "else": "conditional schemas (if / then / else)",
    "dependentSchemas": "dependent schemas",
    "dependentRequired": "dependent required properties",
    "dependencies": "dependencies",
    "unevaluatedProperties": "unevaluated properties",
    "unevaluatedItems": "unevaluated items",
    "minContains": "minContains / maxContains",
    "maxContains": "minContains / maxContains",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "recursive references",
}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SCHEMA_VALUED = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class StructuredOutputsLimits:
    """What one request's constraint may cost (EngineArgs structured_outputs_*, whose defaults
    `default()` takes)."""

    compile_timeout: float
    max_schema_bytes: int
    max_enum_values: int
    max_properties: int

    @classmethod
    def from_args(cls, args: Any) -> "StructuredOutputsLimits":
        return cls(args.structured_outputs_compile_timeout, args.structured_outputs_max_schema_bytes,
                   args.structured_outputs_max_enum_values, args.structured_outputs_max_properties)

    @classmethod
    def default(cls) -> "StructuredOutputsLimits":
        return cls.from_args(EngineArgs())

    def check(self, kind: str, text: str) -> None:
        """ValueError naming the limit or keyword if the constraint (`kind`, canonical `text`, as in
        GrammarKey) is over a limit or uses what xgrammar cannot enforce."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_schema_bytes:
            raise ValueError(f"structured_outputs.{kind} is {size} bytes, over the limit of {self.max_schema_bytes} "
                             "(--structured-outputs-max-schema-bytes)")
        if kind == "choice":
            n = len(json.loads(text))
            if n > self.max_enum_values:
                raise ValueError(f"structured_outputs.choice has {n} choices, over the limit of "
                                 f"{self.max_enum_values} (--structured-outputs-max-enum-values)")
        elif kind == "json":
            self._check_schema(json.loads(text))

    def _check_schema(self, schema: Any) -> None:
        enums = props = 0
        for node, path, depth in _schemas(schema):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}")
            for key in node:
                if key in UNSUPPORTED_KEYWORDS:
                    raise ValueError(f"structured_outputs.json uses {key!r} at {path}: {UNSUPPORTED_KEYWORDS[key]} "
                                     "cannot be enforced by the grammar backend (xgrammar)")
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise ValueError(f"structured_outputs.json has a remote $ref {ref!r} at {path}: only references "
                                 "into the schema itself (#/...) are supported")
            if node.get("uniqueItems") is True:
                raise ValueError(f"structured_outputs.json uses 'uniqueItems' at {path}: unique array items "
                                 "cannot be enforced by the grammar backend (xgrammar)")
            if isinstance(node.get("allOf"), list):
                _check_all_of(node, path)
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            if isinstance(node.get("properties"), dict):
                props += len(node["properties"])
        if enums > self.max_enum_values:
            raise ValueError(f"structured_outputs.json has {enums} enum values, over the limit of "
                             f"{self.max_enum_values} (--structured-outputs-max-enum-values)")
        if props > self.max_properties:
            raise ValueError(f"structured_outputs.json has {props} properties, over the limit of "
                             f"{self.max_properties} (--structured-outputs-max-properties)")


def _schemas(schema: Any, path: str = "#", depth: int = 0) -> Iterator[tuple[dict, str, int]]:
    """Every (sub)schema object with its JSON pointer and depth (schema positions only, so a
    property *named* "not" is not the keyword)."""
    if not isinstance(schema, dict):
        return
    yield schema, path, depth
    for key in _SCHEMA_VALUED:
        if isinstance(schema.get(key), dict):
            yield from _schemas(schema[key], f"{path}/{key}", depth + 1)
    for key in _SCHEMA_LISTS + ("items",):
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _schemas(sub, f"{path}/{key}/{i}", depth + 1)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _schemas(sub, f"{path}/{key}/{name}", depth + 1)


_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$id", "$schema", "$anchor", "$defs", "definitions", "allOf"))


def _check_all_of(node: dict, path: str) -> None:
    """xgrammar enforces an allOf of one part beside annotations only (pydantic's
    ``{"allOf": [{"$ref": ...}], "description": ...}``); any other allOf, an unsatisfiable one
    included, gives an unconstrained grammar, so it is refused."""
    parts = node["allOf"]
    others = sorted(k for k in node if k not in _ANNOTATIONS)
    if len(parts) != 1 or others:
        what = f"{len(parts)} parts" if len(parts) != 1 else f"beside {others}"
        raise ValueError(f"structured_outputs.json has an allOf of {what} at {path}: the grammar backend (xgrammar) "
                         "enforces only an allOf of one schema; merge the parts into one schema")
