"""Function tools of a chat request (OpenAI's shapes, vLLM's semantics), checked without a
server: the tool definitions, `tool_choice`, and the JSON schema a grammar enforces for
tool_choice "required" (an array of `{"name", "parameters"}` call objects) or a named function
(that function's parameters). Bad input raises `ToolSpecError` (a ValueError naming the request
field to blame)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICE_MODES = ("none", "auto", "required")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolSpecError(ValueError):
    def __init__(self, message: str, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: Optional[str]
    parameters: Optional[dict]

    def to_template(self) -> dict:
        """The definition as chat templates take it (OpenAI's `{"type": "function", "function": ...}`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


def parse_tools(tools: Any) -> list[Tool]:
    """Validated function tools; names unique. Raises ToolSpecError (param "tools")."""
    if not isinstance(tools, list):
        raise ToolSpecError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolSpecError(f"{where} must be an object with type 'function' (the only tool type supported)")
        if set(tool) - {"type", "function"}:
            raise ToolSpecError(f"{where} has unknown keys {sorted(set(tool) - {'type', 'function'})}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolSpecError(f"{where}.function must be an object with a name")
        if set(fn) - _FUNCTION_KEYS:
            raise ToolSpecError(f"{where}.function has unknown keys {sorted(set(fn) - _FUNCTION_KEYS)}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolSpecError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got "
                                f"{json.dumps(name)[:80]}")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolSpecError(f"{where}.function.description must be a string")
        if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
            raise ToolSpecError(f"{where}.function.strict must be true or false")
        params = fn.get("parameters")
        if params is not None:
            _check_parameters(params, f"{where}.function.parameters")
        if any(t.name == name for t in out):
            raise ToolSpecError(f"{where}.function.name {name!r} is not unique")
        out.append(Tool(name, description, params))
    return out


def _check_parameters(schema: Any, where: str) -> None:
    """A JSON schema of an object (the arguments of a call)."""
    if not isinstance(schema, dict):
        raise ToolSpecError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ToolSpecError(f"{where} must describe an object (type 'object'), got type {json.dumps(schema['type'])}")
    props = schema.get("properties")
    if props is not None and (not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values())):
        raise ToolSpecError(f"{where}.properties must map names to schemas")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise ToolSpecError(f"{where}.required must be a list of property names")
    defs = schema.get("$defs")
    if defs is not None and not isinstance(defs, dict):
        raise ToolSpecError(f"{where}.$defs must be an object")


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: Optional[str] = None  # the function, for "named"


def parse_tool_choice(choice: Any, tools: list[Tool], tools_sent: bool) -> ToolChoice:
    """`tool_choice` against the tools. Omitted: "auto" with tools, "none" without (OpenAI's
    defaults). Any choice but "none" without tools, an unknown value, or an unknown function name
    raise ToolSpecError (param "tool_choice")."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise ToolSpecError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                                f"{json.dumps(choice)[:80]}", "tool_choice")
        mode = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        mode = "named"
    else:
        raise ToolSpecError("tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if mode != "none" and not tools:
        raise ToolSpecError(f"tool_choice {json.dumps(choice)[:80]} needs tools: send the functions in tools",
                            "tool_choice")
    if mode == "named":
        name = choice["function"]["name"]
        if not any(t.name == name for t in tools):
            raise ToolSpecError(f"tool_choice names the function {name!r}, which is not in tools "
                                f"({', '.join(t.name for t in tools)})", "tool_choice")
        return ToolChoice("named", name)
    return ToolChoice(mode)


def _object_schema(tool: Tool) -> dict:
    return tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}


def _hoist_defs(schemas: list[dict]) -> tuple[list[dict], dict]:
    """Each schema without its $defs, and all $defs merged (refs are '#/$defs/...' of the root)."""
    defs: dict[str, Any] = {}
    out = []
    for schema in schemas:
        local = schema.get("$defs") or {}
        for key, value in local.items():
            if key in defs and defs[key] != value:
                raise ToolSpecError(f"two tools define different $defs named {key!r}")
            defs[key] = value
        out.append({k: v for k, v in schema.items() if k != "$defs"})
    return out, defs


def tool_call_schema(tools: list[Tool], choice: ToolChoice, parallel_tool_calls: bool = True) -> Optional[dict]:
    """The JSON schema the output must follow: a named function's parameters, or for "required"
    an array of 1+ (exactly 1 without parallel calls) `{"name": <tool>, "parameters": <its schema>}`
    objects. None for "none" and "auto"."""
    if choice.mode == "named":
        return _object_schema(next(t for t in tools if t.name == choice.name))
    if choice.mode != "required":
        return None
    params, defs = _hoist_defs([_object_schema(t) for t in tools])
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False} for t, p in zip(tools, params)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
