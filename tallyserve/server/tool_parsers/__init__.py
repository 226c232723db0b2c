"""Tool-call output parsers, chosen by `--tool-call-parser NAME` (vLLM's names): a registry of
`ToolParser` classes; a server makes one instance per choice it parses."""

from __future__ import annotations

from tallyserve.server.tool_parsers.base import (ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                                                 ToolParser, tool_call_id)
from tallyserve.server.tool_parsers.formats import (HermesToolParser, JsonArrayToolParser, Llama3JsonToolParser,
                                                    MistralToolParser, NamedFunctionParser)

_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"tool parser name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
    register_tool_parser(_cls)


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}") from None


__all__ = ["ExtractedToolCalls", "JsonArrayToolParser", "NamedFunctionParser", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolParser",
           "get_tool_parser", "register_tool_parser", "tool_call_id", "tool_parser_names"]
