"""Tool-call parsers: whole text and streams split anywhere give the same calls and content;
malformed output is plain content, never an exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tallyserve.server.tool_parsers import JsonArrayToolParser, NamedFunctionParser, get_tool_parser, tool_parser_names

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": "a \"quoted\" } brace"}
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) +
          '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER)
         + '}; {"name": "get_time", "parameters": {"tz": "CET"}}')
MISTRAL = ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) +
           '}, {"name": "get_time", "arguments": {"tz": "CET"}}]')
CASES = {"hermes": (HERMES, "Let me check."), "llama3_json": (LLAMA, None), "mistral": (MISTRAL, "Sure.")}
EXPECTED = [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]


def stream(parser_cls, pieces: list[str]):
    """Feed `pieces` as a stream; reassemble content and calls the way a client does."""
    parser, text, content, calls = parser_cls(), "", "", {}
    for i, piece in enumerate(pieces + [""]):
        previous, text = text, text + piece
        delta = parser.extract_tool_calls_streaming(previous, text, piece, finished=i == len(pieces))
        content += delta.content
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.id is not None and d.id.startswith("call_") and d.name and d.arguments == ""
                assert d.index == len(calls)  # calls open in order
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None and d.arguments
            calls[d.index][2] += d.arguments
    return content, [tuple(calls[i]) for i in range(len(calls))]


def test_registry_names_the_three_formats():
    assert {"hermes", "llama3_json", "mistral"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_text(name):
    text, content = CASES[name]
    out = get_tool_parser(name)().extract_tool_calls(text)
    assert out.tools_called and out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == EXPECTED
    ids = [c.id for c in out.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert out.tool_calls[0].arguments == json.dumps(WEATHER)  # the model's own argument text


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_split_at_every_point_reassembles(name):
    text, _ = CASES[name]
    cls = get_tool_parser(name)
    whole = cls().extract_tool_calls(text)
    want = ((whole.content or ""), [(c.name, c.arguments) for c in whole.tool_calls])
    for cut in range(len(text) + 1):
        content, calls = stream(cls, [text[:cut], text[cut:]])
        assert (content, [(n, a) for _, n, a in calls]) == want, cut
    content, calls = stream(cls, list(text))  # one character at a time
    assert (content, [(n, a) for _, n, a in calls]) == want
    assert len({i for i, _, _ in calls}) == len(calls)


def test_streamed_arguments_arrive_in_pieces():
    pieces = list(HERMES)
    parser, text, fragments = get_tool_parser("hermes")(), "", 0
    for piece in pieces:
        prev, text = text, text + piece
        fragments += sum(1 for d in parser.extract_tool_calls_streaming(prev, text, piece).tool_calls if d.arguments)
    assert fragments > 20  # not one block at the end


@pytest.mark.parametrize("name,text", [
    ("hermes", "Just an answer, no tools."),
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut off
    ("hermes", '<tool_call>{"name": "f"} garbage'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then prose'),
    ("mistral", '[{"a": 1}]'),  # a bare array, but no call in it
    ("mistral", "[1, 2, 3] are numbers"),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", "The answer is {x}."),
    ("mistral", "[TOOL_CALLS]"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}'),  # array not closed: the call is whole
    ("mistral", "[TOOL_CALLS] not an array"),
    ("mistral", "<tool_call> a different format"),
])
def test_malformed_output_is_plain_content(name, text):
    out = get_tool_parser(name)().extract_tool_calls(text)
    if out.tools_called:  # the one lenient case: a complete call whose array was not closed
        assert text.startswith("[TOOL_CALLS]") and out.tool_calls[0].name == "f"
        return
    assert out.content == text and out.tool_calls == []
    content, calls = stream(get_tool_parser(name), list(text))
    if not calls:
        assert content == text  # held-back text is released at the end


def test_hermes_closing_tag_left_out_at_the_end_and_text_after_calls():
    out = get_tool_parser("hermes")().extract_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert out.tools_called and out.content is None and out.tool_calls[0].arguments == "{}"
    out = get_tool_parser("hermes")().extract_tool_calls('<tool_call>{"name": "f"}</tool_call> done')
    assert out.tool_calls[0].arguments == "{}" and out.content is None


def test_partial_marker_is_held_back_then_released():
    parser = get_tool_parser("hermes")()
    assert parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool").content == "Hi"
    assert parser.extract_tool_calls_streaming("Hi <tool", "Hi <toolbox", "box").content == " <toolbox"


def test_json_array_parser_of_required_choice():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    out = JsonArrayToolParser().extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert out.content is None
    _, calls = stream(JsonArrayToolParser, list(text))
    assert [(n, a) for _, n, a in calls] == [("a", '{"x": 1}'), ("b", "{}")]


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), data=st.data())
def test_fuzzed_output_never_raises(name, data):
    text, _ = CASES[name]
    # mutate a valid output: cut, drop or insert characters anywhere
    chars = list(text)
    for _ in range(data.draw(st.integers(0, 4))):
        pos = data.draw(st.integers(0, len(chars)))
        op = data.draw(st.sampled_from(["cut", "drop", "insert"]))
        if op == "cut":
            chars = chars[:pos]
        elif op == "drop" and pos < len(chars):
            del chars[pos]
        else:
            chars.insert(pos, data.draw(st.sampled_from(list('{}[]",:; \\ax'))))
    mutated = "".join(chars)
    cls = get_tool_parser(name)
    out = cls().extract_tool_calls(mutated)
    if not out.tools_called:
        assert out.content == mutated
    for c in out.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)
    cut = data.draw(st.integers(0, len(mutated)))
    content, calls = stream(cls, [mutated[:cut], mutated[cut:]])
    if out.tools_called:  # well formed: the stream agrees
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in out.tool_calls]
        assert content == (out.content or "")


@pytest.mark.parametrize("name,text,content", [
    ("mistral", ' [{"name": "f", "arguments": {"a": 1}}]', None),  # [TOOL_CALLS] skipped as a special token
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}<|eom_id|>', None),  # end-of-turn kept in the text
    ("mistral", 'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]</s>', "Sure"),
])
def test_formats_with_special_tokens_skipped_or_kept(name, text, content):
    out = get_tool_parser(name)().extract_tool_calls(text)
    assert out.tools_called and out.content == content
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a": 1}')]
    _, calls = stream(get_tool_parser(name), list(text))
    assert [(n, a) for _, n, a in calls] == [("f", '{"a": 1}')]


def test_forced_calls_cut_anywhere_are_the_calls_so_far_whole_and_streamed():
    """tool_choice "required" / a named function (output held to the calls by a grammar), cut at
    every point (max_tokens): the calls as far as they go (those with a complete name; the last
    one's arguments a prefix of its full arguments), never content, marked incomplete; streamed,
    the deltas reassemble to the same calls."""
    required = ('[{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) +
                '}, {"name": "get_time", "parameters": {"tz": "CET"}}]')
    for make, text in ((JsonArrayToolParser, required), (lambda: NamedFunctionParser("get_weather"), json.dumps(WEATHER))):
        full = [(c.name, c.arguments) for c in make().extract_tool_calls(text).tool_calls]
        assert make().extract_tool_calls(text).complete and len(full) in (1, 2)
        partial = 0
        for cut in range(len(text)):
            out = make().extract_tool_calls(text[:cut])
            calls = [(c.name, c.arguments) for c in out.tool_calls]
            assert out.content is None and out.tools_called == bool(calls), (cut, out)
            assert len(calls) <= len(full) and all(n == fn and fa.startswith(a) for (n, a), (fn, fa) in zip(calls, full))
            content, streamed = stream(make, list(text[:cut]))
            assert content == "" and [(n, a) for _, n, a in streamed] == calls, cut
            partial += not out.complete and bool(calls) and calls[-1][1] not in ("", full[len(calls) - 1][1])
        assert partial > len(text) // 3  # most cuts fall inside some arguments
    assert not get_tool_parser("hermes")().extract_tool_calls('<tool_call>{"name": "f", "arguments": {"a": ').tools_called
