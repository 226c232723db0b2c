"""The tool parser interface: a parser reads model text as plain content and tool calls, whole
(`extract_tool_calls`) or as it streams (`extract_tool_calls_streaming`, one instance per
choice). A parser only implements `parse(text, final)`: what the text holds so far (where the
content ends, and the calls as far as they go); both entry points derive from it, so the deltas
of a stream always reassemble to the calls and content of the whole text.

Content is the text before the first call (trailing whitespace dropped when calls follow).
Arguments are the model's own JSON text of each call's arguments object. Text that is not a
well-formed call (bad JSON, no name, arguments that are not an object, a call cut off) makes the
whole output plain content; nothing here raises on model output.

Except for a `forced` parser (tool_choice "required" or a named function: a grammar holds the
output to the calls, so it is never content): an output cut off inside its calls (max_tokens, a
stop string) gives the calls as far as they go, those whose name is complete, the last one's
arguments a prefix of a JSON object, and no content; `complete` (whole) or `truncated` (streaming)
says so, and the caller keeps the engine's finish_reason ("length"), never "tool_calls"."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from tallyserve.server.tool_parsers.json_scan import WHITESPACE, CallSpan, Malformed


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=tool_call_id)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: Optional[str]
    complete: bool = True  # False: a forced parser's calls, cut off (the last one's arguments partial)


@dataclass
class ToolCallDelta:
    """One call's piece of a stream: the first carries id and name (arguments ""), later ones
    only argument text."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class Parse:
    """What `text` holds so far: content is text[:content_end]; `started`: a call marker was seen;
    `hold`: characters at the end that may still turn out to be a marker."""

    content_end: int
    calls: list[CallSpan] = field(default_factory=list)
    started: bool = False
    hold: int = 0


def held_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ToolParser:
    """Subclasses set `name` and implement `parse`."""

    name: ClassVar[str] = ""
    forced: ClassVar[bool] = False  # the output is exactly the calls (grammar-held): cut off, it stays calls

    def __init__(self) -> None:
        self._content_sent = 0
        self._calls_sent: list[tuple[str, int]] = []  # (id, argument characters sent)
        self._broken = False
        self.truncated = False  # streaming, forced: the output ended inside its calls

    def parse(self, text: str, final: bool) -> Parse:
        raise NotImplementedError

    # ------------------------------------------------------------------ whole text

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        plain = ExtractedToolCalls(False, [], text)
        try:
            p = self.parse(text, final=True)
        except Malformed:
            return plain
        if not p.started or not p.calls or not all(c.complete for c in p.calls):
            if self.forced and p.started:  # cut off: the calls so far (named ones), never content
                calls = [ToolCall(c.name, c.arguments(text)) for c in p.calls if c.name is not None]
                return ExtractedToolCalls(bool(calls), calls, None, complete=False)
            return plain
        calls = [ToolCall(c.name, c.arguments(text)) for c in p.calls]
        if not all(_is_object(c.arguments) for c in calls):
            return plain
        content = text[:p.content_end].rstrip(WHITESPACE)
        return ExtractedToolCalls(True, calls, content or None)

    # ------------------------------------------------------------------ streaming

    @property
    def tools_called(self) -> bool:
        """Whether this stream has sent a tool call."""
        return bool(self._calls_sent)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     finished: bool = False) -> StreamDelta:
        """What to send now that the text grew from `previous_text` by `delta_text`; `finished`:
        the last call, where held-back text is released."""
        text = current_text
        if self._broken:
            return StreamDelta(self._take_content(text, len(text)) if not self._calls_sent else "")
        try:
            p = self.parse(text, final=finished)
            if finished and p.started and not (p.calls and all(c.complete for c in p.calls)):
                if not self.forced:
                    raise Malformed("the output ends inside a call")
                self.truncated = True  # the calls as far as they go: the rest of their arguments below
            elif finished and not all(_is_object(c.arguments(text)) for c in p.calls):
                raise Malformed("arguments are not a JSON object")
        except Malformed:
            self._broken = True
            return StreamDelta(self._take_content(text, len(text)) if not self._calls_sent else "")
        out = StreamDelta()
        if not p.started:
            end = len(text) - p.hold
            if not finished:
                end = len(text[:end].rstrip(WHITESPACE))  # trailing whitespace waits: a call may follow
            out.content = self._take_content(text, len(text) if finished else end)
            return out
        if not self._calls_sent:
            out.content = self._take_content(text, len(text[:p.content_end].rstrip(WHITESPACE)))
        for index, call in enumerate(p.calls):
            if index == len(self._calls_sent):
                if call.name is None:
                    break
                self._calls_sent.append((tool_call_id(), 0))
                out.tool_calls.append(ToolCallDelta(index, "", self._calls_sent[index][0], call.name))
            call_id, sent = self._calls_sent[index]
            args = call.arguments(text)
            if len(args) > sent:
                self._calls_sent[index] = (call_id, len(args))
                out.tool_calls.append(ToolCallDelta(index, args[sent:]))
        return out

    def _take_content(self, text: str, end: int) -> str:
        if end <= self._content_sent:
            return ""
        piece = text[self._content_sent:end]
        self._content_sent = end
        return piece


def _is_object(raw: str) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False
