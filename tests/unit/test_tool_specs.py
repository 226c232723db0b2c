"""Tool definitions, tool_choice, the grammar schema of "required" / named choices, and how the
grammar's JSON becomes tool calls (whole and streamed) and reaches the chat template."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tallyserve.server.errors import APIError
from tallyserve.server.serving_tools import ChoiceTools, plan_tools, with_tool_constraints
from tallyserve.sampling_params import SamplingParams
from tallyserve.tool_specs import ToolSpecError, parse_tool_choice, parse_tools, tool_call_schema

P = {"type": "object", "properties": {"x": {"type": "integer"}, "item": {"$ref": "#/$defs/Item"}},
     "$defs": {"Item": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": P}},
         {"type": "function", "function": {"name": "b", "description": "no parameters"}}]
CTX = SimpleNamespace(enable_auto_tool_choice=True, tool_parser="hermes")


def test_required_schema_is_an_array_of_named_calls():
    tools = parse_tools(TOOLS)
    schema = tool_call_schema(tools, parse_tool_choice("required", tools, True))
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [{"type": "string", "enum": ["a"]},
                                                        {"type": "string", "enum": ["b"]}]
    assert items[0]["properties"]["parameters"] == {k: v for k, v in P.items() if k != "$defs"}
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == P["$defs"]  # refs resolve from the root
    single = tool_call_schema(tools, parse_tool_choice("required", tools, True), parallel_tool_calls=False)
    assert single["maxItems"] == 1


def test_named_schema_is_the_functions_parameters():
    tools = parse_tools(TOOLS)
    assert tool_call_schema(tools, parse_tool_choice({"type": "function", "function": {"name": "a"}}, tools, True)) == P
    assert tool_call_schema(tools, parse_tool_choice("auto", tools, True)) is None


def test_choice_defaults_and_errors():
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools, True).mode == "auto"
    assert parse_tool_choice(None, [], False).mode == "none"
    assert parse_tool_choice("none", [], False).mode == "none"
    for bad in ("required", {"type": "function", "function": {"name": "a"}}):
        with pytest.raises(ToolSpecError, match="needs tools"):
            parse_tool_choice(bad, [], False)
    with pytest.raises(ToolSpecError) as e:
        parse_tool_choice({"type": "function", "function": {"name": "zz"}}, tools, True)
    assert e.value.param == "tool_choice"


def test_plan_sets_the_grammar_and_refuses_auto_without_the_flag():
    plan = plan_tools(CTX, TOOLS, "required", False)
    params = with_tool_constraints(SamplingParams(max_tokens=5), plan)
    assert params.structured_outputs.json == plan.schema and plan.schema["maxItems"] == 1
    assert plan.template_tools[1] == {"type": "function", "function": {
        "name": "b", "description": "no parameters", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(APIError) as e:
        plan_tools(SimpleNamespace(enable_auto_tool_choice=False, tool_parser=None), TOOLS, "auto", None)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert plan_tools(CTX, None, None, True) is None


def _stream(tools: ChoiceTools, text: str, step: int = 3):
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] + [""]
    for k, piece in enumerate(pieces):
        c, deltas = tools.delta(piece, k == len(pieces) - 1)
        content += c or ""
        for d in deltas:
            dumped = d.model_dump()
            if d.id is not None:
                assert dumped == {"index": d.index, "id": d.id, "type": "function",
                                  "function": {"name": d.function.name, "arguments": ""}}
                calls[d.index] = [d.function.name, ""]
            else:
                assert dumped == {"index": d.index, "function": {"arguments": d.function.arguments}}
                calls[d.index][1] += d.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_required_output_becomes_tool_calls():
    plan = plan_tools(CTX, TOOLS, "required", None)
    text = '[{"name": "a", "parameters": {"x": 1, "item": "i"}}, {"name": "b", "parameters": {}}]'
    content, calls, finish = ChoiceTools(plan).whole(text, "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("a", {"x": 1, "item": "i"}), ("b", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    t = ChoiceTools(plan)
    assert _stream(t, text) == ("", [("a", '{"x": 1, "item": "i"}'), ("b", "{}")])
    assert t.finish_reason("stop") == "tool_calls" and t.finish_reason("length") == "length"


def test_named_output_becomes_one_call_announced_at_once():
    plan = plan_tools(CTX, TOOLS, {"type": "function", "function": {"name": "a"}}, None)
    content, calls, finish = ChoiceTools(plan).whole('{"x": 2}', "stop")
    assert content is None and finish == "tool_calls" and calls[0].function.arguments == '{"x": 2}'
    _, first = ChoiceTools(plan).delta("", False)
    assert first[0].function.name == "a" and first[0].id.startswith("call_")  # before any argument text
    assert _stream(ChoiceTools(plan), ' {"x": 2} ') == ("", [("a", '{"x": 2}')])
    # cut off by max_tokens: the partial call comes back as OpenAI sends it (arguments cut, finish "length")
    content, calls, finish = ChoiceTools(plan).whole('{"x": ', "length")
    assert content is None and finish == "length"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", '{"x": ')]


def test_auto_output_through_the_hermes_parser():
    plan = plan_tools(CTX, TOOLS, "auto", None)
    text = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 3}}\n</tool_call>'
    content, calls, finish = ChoiceTools(plan).whole(text, "stop")
    assert content == "Sure." and calls[0].function.name == "a" and finish == "tool_calls"
    assert _stream(ChoiceTools(plan), text, 1) == ("Sure.", [("a", '{"x": 3}')])
    assert ChoiceTools(plan).whole("No tools needed.", "stop") == ("No tools needed.", None, "stop")


def test_offline_chat_renders_tools_and_tool_history(tmp_path):
    from tallyserve import LLM
    from tests.server.test_tool_calling import HISTORY, TOOL_TEMPLATE, WEATHER
    from tests.tiny_models import make_tiny_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = make_tiny_model(tmp_path, "llama", seed=0)
    make_tiny_tokenizer(path)
    llm = LLM(model=path, num_gpu_blocks_override=64, block_size=8)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    out = llm.chat(HISTORY, params, tools=[WEATHER], chat_template=TOOL_TEMPLATE)[0]
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith('<|im_start|>system\nTools: {"name": "get_weather"')
    assert '"arguments": {"city": "Paris", "days": 1}}</tool_call>' in prompt and "sunny, 21 C" in prompt
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="not unique"):
        llm.chat(HISTORY, params, tools=[WEATHER, WEATHER])


def test_chunk_groups_keep_one_entry_per_call_and_headers_apart():
    from tallyserve.server.protocol import DeltaFunctionCall, DeltaToolCall
    from tallyserve.server.serving_tools import chunk_groups

    def header(i):
        return DeltaToolCall(index=i, id=f"call_{i}", type="function", function=DeltaFunctionCall(name="f", arguments=""))

    def args(i, text):
        return DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=text))

    groups = chunk_groups([args(0, '{"a"'), args(0, ": 1}"), header(1), args(1, "{"), args(1, "}")])
    assert [[d.model_dump() for d in g] for g in groups] == [
        [{"index": 0, "function": {"arguments": '{"a": 1}'}}, header(1).model_dump()],
        [{"index": 1, "function": {"arguments": "{}"}}]]
    assert chunk_groups([]) == []


def test_auto_without_parallel_calls_keeps_the_first_call():
    plan = plan_tools(CTX, TOOLS, "auto", False)
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    _, calls, finish = ChoiceTools(plan).whole(text, "stop")
    assert [c.function.name for c in calls] == ["a"] and finish == "tool_calls"
    assert _stream(ChoiceTools(plan), text, 2) == ("", [("a", '{"x": 1}')])
    _, calls, _ = ChoiceTools(plan_tools(CTX, TOOLS, "auto", True)).whole(text, "stop")
    assert [c.function.name for c in calls] == ["a", "b"]


def test_empty_tool_calls_in_history_are_no_calls():
    from tallyserve.tokenizer import normalise_messages

    out = normalise_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []}])
    assert out[1]["content"] == "y" and out[1]["tool_calls"] == []


def test_serve_flags_for_tool_parsing():
    from tallyserve.cli import build_parser
    from tallyserve.server.cli import _validate

    parser = build_parser()
    ns = parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert ns.enable_auto_tool_choice and ns.tool_call_parser == "llama3_json"
    _validate(ns)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        _validate(parser.parse_args(["serve", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):  # argparse names the known parsers
        parser.parse_args(["serve", "--tool-call-parser", "nope"])
