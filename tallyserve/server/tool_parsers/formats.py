"""The tool-call formats (vLLM's parser names):

- `hermes` (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block
  per call, after optional content.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`; a special token after the calls (an
  end-of-turn kept by skip_special_tokens false) is ignored.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional content, or the
  bare array opening the output (`[TOOL_CALLS]` is a special token, skipped by default).

Each accepts "arguments" or "parameters" for the arguments object. `JsonArrayToolParser` reads
the `[{"name": ..., "parameters": {...}}, ...]` that a grammar forces for tool_choice "required"."""

from __future__ import annotations

from tallyserve.server.tool_parsers.base import Parse, ToolParser, held_marker_prefix
from tallyserve.server.tool_parsers.json_scan import CallSpan, Malformed, scan_call, scan_value, skip_ws


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parse:
        first = text.find(self.START)
        if first < 0:
            return Parse(len(text), hold=held_marker_prefix(text, (self.START,)))
        p = Parse(first, started=True)
        i = first
        while True:
            call = scan_call(text, skip_ws(text, i + len(self.START)), final)
            p.calls.append(call)
            if not call.complete:
                return p
            i = skip_ws(text, call.end)
            if text.startswith(self.END, i):
                i = skip_ws(text, i + len(self.END))
            elif self.END.startswith(text[i:]):
                return p  # the closing tag is coming (or, at the very end, was left out)
            else:
                raise Malformed(f"expected {self.END} at {i}")
            if not text.startswith(self.START, i):
                return p  # text after the calls is not content
            # another call follows


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parse:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Parse(len(text))
        i = start
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        elif text[i] != "{":
            if not final and self.TAG.startswith(text[i:]):
                return Parse(len(text), hold=len(text) - i)
            return Parse(len(text))  # plain content: calls only open the output
        # calls separated by ';', up to the end or a special token such as <|eom_id|>
        return scan_calls(text, i, final, Parse(start, started=True), sep=";", end="<")


def parse_call_array(text: str, i: int, final: bool, p: Parse) -> Parse:
    """The JSON array of call objects starting at `text[i]`, its calls appended to `p`."""
    if i >= len(text):
        return p
    if text[i] != "[":
        raise Malformed(f"expected '[' at {i}")
    return scan_calls(text, skip_ws(text, i + 1), final, p, sep=",", end="]")


def scan_calls(text: str, i: int, final: bool, p: Parse, sep: str, end: str) -> Parse:
    """Call objects from `text[i]` separated by `sep`, up to the text's end or `end`; appended to `p`."""
    while i < len(text):
        call = scan_call(text, i, final)
        p.calls.append(call)
        if not call.complete:
            return p
        i = skip_ws(text, call.end)
        if i >= len(text) or text[i] == end:
            return p
        if text[i] != sep:
            raise Malformed(f"expected {sep!r} or {end!r} at {i}")
        i = skip_ws(text, i + 1)
    return p


class MistralToolParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    BARE = '[{"'  # the array opening the output, its special-token marker skipped

    def parse(self, text: str, final: bool) -> Parse:
        first = text.find(self.MARKER)
        if first < 0:
            start = skip_ws(text, 0)
            head = text[start:start + len(self.BARE)]
            if head == self.BARE:
                return parse_call_array(text, start, final, Parse(start, started=True))
            if head and self.BARE.startswith(head) and not final:
                return Parse(len(text), hold=len(text) - start)  # may open a bare array
            return Parse(len(text), hold=held_marker_prefix(text, (self.MARKER,)))
        return parse_call_array(text, skip_ws(text, first + len(self.MARKER)), final, Parse(first, started=True))


class JsonArrayToolParser(ToolParser):
    """The output is exactly a JSON array of calls (tool_choice "required", forced by a grammar)."""

    name = "json_array"
    forced = True

    def parse(self, text: str, final: bool) -> Parse:
        return parse_call_array(text, skip_ws(text, 0), final, Parse(0, started=True))


class NamedFunctionParser(ToolParser):
    """The output is exactly the arguments object of one known function (a named tool_choice,
    forced by a grammar): one call, announced before its first character arrives."""

    name = "named_function"
    forced = True

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parse:
        call = CallSpan(name=self.function_name)
        p = Parse(0, [call], started=True)
        i = skip_ws(text, 0)
        if i >= len(text):
            return p
        if text[i] != "{":
            raise Malformed("the arguments must be a JSON object")
        call.args_start = i
        end = scan_value(text, i, final)
        if end is not None:
            if skip_ws(text, end) < len(text):
                raise Malformed("text after the arguments object")
            call.args_end = call.end = end
        return p
