"""A small incremental scanner over JSON text, for tool-call parsers: where a value ends (or that
it has not ended yet), and the raw spans of the fields of a call object, on text that may stop
anywhere. It checks structure (brackets, strings, separators), not every detail: a complete value
is checked by `json.loads` afterwards."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_CLOSE = {"{": "}", "[": "]"}
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*+"', re.S)  # a string's body and closing quote
_STRUCTURAL = re.compile(r'["{}\[\]]')


class Malformed(ValueError):
    """The text cannot be (the start of) what the parser expects."""


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def scan_string(text: str, pos: int) -> Optional[int]:
    """`text[pos]` is a double quote: the index after the closing quote, or None if the text ends first."""
    m = _STRING_REST.match(text, pos + 1)
    return m.end() if m else None


def scan_value(text: str, pos: int, final: bool) -> Optional[int]:
    """The end of the JSON value starting at `text[pos]` (no leading whitespace), or None when the
    text ends inside it. `final`: the text will not grow, so a trailing number or literal is complete."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return scan_string(text, pos)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        i = pos + 1
        while True:
            m = _STRUCTURAL.search(text, i)  # the scan runs on every streamed delta: jump in C
            if m is None:
                return None
            i = m.start()
            c = text[i]
            if c == '"':
                end = scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if c != stack.pop():
                    raise Malformed(f"mismatched {c!r} at {i}")
                if not stack:
                    return i + 1
            i += 1
    if c in _SCALAR_CHARS:
        i = pos
        while i < len(text) and text[i] in _SCALAR_CHARS:
            i += 1
        return i if i < len(text) or final else None
    raise Malformed(f"unexpected {c!r} at {pos}")


@dataclass
class CallSpan:
    """One call object as far as the text goes: its name once the name value is complete, the raw
    span of its arguments value (end None while that value is still open), and its end once closed."""

    name: Optional[str] = None
    args_start: Optional[int] = None
    args_end: Optional[int] = None
    end: Optional[int] = None

    def arguments(self, text: str) -> str:
        """The raw arguments text so far ("{}" for a closed call without arguments)."""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        return text[self.args_start:self.args_end if self.args_end is not None else len(text)]

    @property
    def complete(self) -> bool:
        return self.end is not None


NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call(text: str, pos: int, final: bool) -> CallSpan:
    """The call object `{"name": ..., "arguments"|"parameters": {...}}` starting at `text[pos]`.
    Raises Malformed for text that cannot become such an object."""
    call = CallSpan()
    if pos >= len(text):
        return call
    if text[pos] != "{":
        raise Malformed(f"expected a call object at {pos}")
    i, first = pos + 1, True
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call
        if text[i] == "}" and first:
            raise Malformed("an empty call object")
        if text[i] == "}":
            if call.name is None:
                raise Malformed("a call object without a name")
            call.end = i + 1
            return call
        if not first:
            if text[i] != ",":
                raise Malformed(f"expected ',' at {i}")
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return call
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        key_end = scan_string(text, i)
        if key_end is None:
            return call
        key = _loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return call
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return call
        start = i
        if key in ARGUMENT_KEYS and call.args_start is None:
            if text[i] != "{":
                raise Malformed(f"{key} must be an object")
            call.args_start = start
        end = scan_value(text, start, final)
        if end is None:
            return call
        if key in NAME_KEYS:
            name = _loads(text[start:end])
            if not isinstance(name, str) or not name:
                raise Malformed("the call's name must be a non-empty string")
            call.name = name
        elif call.args_start == start:
            if not isinstance(_loads(text[start:end]), dict):
                raise Malformed(f"{key} must be a JSON object")
            call.args_end = end
        i, first = end, False


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise Malformed(f"invalid JSON {raw[:40]!r}") from exc
