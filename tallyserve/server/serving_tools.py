"""Function tools in chat completions (OpenAI's wire format, vLLM's semantics and flags).

- The tool definitions go to the chat template (`tools=`), for every tool_choice.
- tool_choice "auto" (the default with tools) parses the output with the server's
  `--tool-call-parser`, and only on a server started with `--enable-auto-tool-choice`
  (otherwise a 400 naming tool_choice, as vLLM's).
- tool_choice "required" or a named function is enforced by a grammar: the request's sampling
  params get a JSON schema (`structured_outputs`, without optional whitespace), and the JSON the
  model is held to is read directly as the calls.
- "none": the tools may be rendered, the output is plain content.

Found calls come back as `message.tool_calls` (or streamed tool-call deltas), the text before
them as content, and finish_reason "tool_calls".

Cut off by max_tokens (or a stop string) inside the calls, "required" and a named function answer
as OpenAI does, streamed or not: `tool_calls` holds the calls as far as they go (those whose name
is complete; the last one's `arguments` the JSON text generated so far, not parseable), content
is null, and finish_reason stays the engine's ("length"), never "tool_calls". (An "auto" output cut
inside a call is unchanged: whole, it is plain content; streamed, the call deltas already sent stand.)"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from tallyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tallyserve.server.errors import bad_request
from tallyserve.server.structured import CONSTRAINT_FIELD
from tallyserve.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from tallyserve.server.tool_parsers import (JsonArrayToolParser, NamedFunctionParser, ToolParser, get_tool_parser)
from tallyserve.tool_specs import (Tool, ToolChoice, ToolSpecError, parse_tool_choice, parse_tools,
                                   tool_call_schema)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]
    choice: ToolChoice
    parser_cls: Optional[type[ToolParser]] = None  # "auto"
    schema: Optional[dict] = None  # "required" / "named": the grammar
    parallel: bool = True  # false: only the first call the model makes counts ("auto"; the grammar holds the rest)

    @property
    def template_tools(self) -> Optional[list[dict]]:
        return [t.to_template() for t in self.tools] or None

    def choice_parser(self) -> Optional[ToolParser]:
        """A fresh parser for one choice's output (None: plain content)."""
        if self.choice.mode == "auto":
            return self.parser_cls()
        if self.choice.mode == "required":
            return JsonArrayToolParser()
        if self.choice.mode == "named":
            return NamedFunctionParser(self.choice.name)
        return None


def plan_tools(ctx: Any, tools: Any, tool_choice: Any, parallel_tool_calls: Optional[bool],
               beam_search: bool = False) -> Optional[ToolPlan]:
    """The request's tools and tool_choice, checked (400s naming the field). None: no tools."""
    if tools is None and tool_choice is None:
        return None
    try:
        parsed = parse_tools(tools) if tools is not None else []
        choice = parse_tool_choice(tool_choice, parsed, tools is not None)
        schema = tool_call_schema(parsed, choice, parallel_tool_calls is not False)
    except ToolSpecError as exc:
        raise bad_request(str(exc), exc.param) from exc
    parser_cls = None
    if choice.mode == "auto":
        if not getattr(ctx, "enable_auto_tool_choice", False) or not getattr(ctx, "tool_parser", None):
            raise bad_request('"auto" tool choice requires the server to be started with --enable-auto-tool-choice '
                              'and --tool-call-parser; send tool_choice "none", "required" or a named function',
                              "tool_choice")
        parser_cls = get_tool_parser(ctx.tool_parser)
    if beam_search and choice.mode != "none":
        raise bad_request("tool calls are not supported with use_beam_search", "tool_choice", "unsupported_parameter")
    return ToolPlan(parsed, choice, parser_cls, schema, parallel_tool_calls is not False)


def with_tool_constraints(params: SamplingParams, plan: Optional[ToolPlan]) -> SamplingParams:
    """The sampling params with the tool grammar (required / named). Special tokens stay skipped
    (the text would end in the end-of-turn token otherwise): the parsers also read formats whose
    marker is a special token without it."""
    if plan is None:
        return params
    changes: dict[str, Any] = {}
    if plan.schema is not None:
        if params.structured_outputs is not None:
            raise bad_request("tool_choice 'required' or a named function is itself a structured output; it cannot "
                              "be combined with another (response_format, structured_outputs)", "tool_choice")
        # compact JSON: calls are read by programs, and free whitespace lets a weak model pad forever
        changes["structured_outputs"] = StructuredOutputsParams(json=plan.schema, disable_any_whitespace=True)
        CONSTRAINT_FIELD.set("tools")  # a schema that does not compile is a 400 naming tools
    return replace(params, **changes) if changes else params


def tool_finish_reason(finish_reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class ChoiceTools:
    """One choice's output read for tool calls, whole or as it streams."""

    def __init__(self, plan: Optional[ToolPlan]) -> None:
        self.parser = plan.choice_parser() if plan is not None else None
        self.max_calls = None if plan is None or plan.parallel else 1
        self.text = ""

    @property
    def active(self) -> bool:
        return self.parser is not None

    def whole(self, text: str, finish_reason: Optional[str]):
        """(content, tool_calls or None, finish_reason) of a finished output."""
        if self.parser is None:
            return text, None, finish_reason
        out = self.parser.extract_tool_calls(text)
        if not out.tools_called:
            return out.content, None, finish_reason  # the text; None for forced calls cut before any name
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in out.tool_calls[:self.max_calls]]
        return out.content, calls, tool_finish_reason(finish_reason, out.complete)

    def delta(self, delta_text: str, finished: bool):
        """(content delta, tool-call deltas) for text that just arrived."""
        previous, self.text = self.text, self.text + delta_text
        d = self.parser.extract_tool_calls_streaming(previous, self.text, delta_text, finished)
        calls = []
        for c in d.tool_calls:
            if self.max_calls is not None and c.index >= self.max_calls:
                continue
            if c.id is not None:
                calls.append(DeltaToolCall(index=c.index, id=c.id, type="function",
                                           function=DeltaFunctionCall(name=c.name, arguments="")))
            else:
                calls.append(DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.arguments)))
        return d.content, calls

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        p = self.parser
        return tool_finish_reason(finish_reason, p is not None and p.tools_called and not p.truncated)


def chunk_groups(calls: list[DeltaToolCall]) -> list[list[DeltaToolCall]]:
    """Tool-call deltas as OpenAI streams them: at most one entry per call in a chunk (argument
    fragments of a call merged), and a call's first delta (id, name, arguments "") alone for that
    call, its first arguments in the next chunk."""
    groups: list[list[DeltaToolCall]] = [[]]
    for d in calls:
        same = next((x for x in groups[-1] if x.index == d.index), None)
        if same is None:
            groups[-1].append(d)
        elif same.id is None and d.id is None:
            same.function.arguments += d.function.arguments
        else:
            groups.append([d])
    return [g for g in groups if g]
