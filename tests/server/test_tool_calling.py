"""Function tools over /v1/chat/completions: definitions reach the chat template, tool_choice
"none" / "auto" (with --enable-auto-tool-choice and the hermes parser) / "required" / a named
function (grammar-enforced), tool-call history, OpenAI's streamed tool-call deltas (reassembled by
the official client), and the 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A ChatML template that renders tools, assistant tool calls (arguments as objects) and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": {{ c.function.name | tojson }}, "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"},
]


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body})


def _error(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def test_tools_are_rendered_by_the_chat_template(tools_server):
    base = {"messages": USER, "chat_template": TOOL_TEMPLATE, "max_tokens": 3}
    without = _post(tools_server, base).json()
    with_tools = _post(tools_server, {**base, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 20
    msg = with_tools["choices"][0]["message"]
    assert "tool_calls" not in msg and isinstance(msg["content"], str)  # "none": plain content
    assert with_tools["choices"][0]["finish_reason"] in ("stop", "length")


def test_tokenize_renders_tools_as_the_chat_completion_does(tools_server):
    """/tokenize with `tools` gives exactly the prompt a chat completion with those tools counts; a bad
    tool or tools with a text prompt is a 400 naming `tools`."""
    base = {"model": MODEL, "messages": USER, "chat_template": TOOL_TEMPLATE}
    r = httpx.post(tools_server.base_url + "/tokenize", headers=AUTH, timeout=60, json={**base, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    usage = _post(tools_server, {"messages": USER, "chat_template": TOOL_TEMPLATE, "tools": [WEATHER, TIME],
                                 "tool_choice": "none", "max_tokens": 1}).json()["usage"]
    assert r.json()["count"] == usage["prompt_tokens"]
    text = httpx.post(tools_server.base_url + "/detokenize", headers=AUTH, timeout=60,
                      json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.startswith('<|im_start|>system\nTools: {"name": "get_weather"') and '"get_time"' in text
    for body in ({**base, "tools": [{"type": "function", "function": {"description": "no name"}}]},
                 {"model": MODEL, "prompt": "hi", "tools": [WEATHER]}):
        bad = httpx.post(tools_server.base_url + "/tokenize", headers=AUTH, timeout=60, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"].split("[")[0].split(".")[0] == "tools", bad.text


def test_tool_history_reaches_the_template_with_object_arguments(tools_server):
    r = httpx.post(tools_server.base_url + "/tokenize", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": HISTORY, "chat_template": TOOL_TEMPLATE})
    assert r.status_code == 200, r.text
    text = httpx.post(tools_server.base_url + "/detokenize", headers=AUTH, timeout=60,
                      json={"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text
    # the round trip's last step: the tool result goes back and the model answers in plain content
    out = _post(tools_server, {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none",
                               "chat_template": TOOL_TEMPLATE}).json()
    assert out["choices"][0]["message"]["content"] is not None and "tool_calls" not in out["choices"][0]["message"]


@pytest.mark.parametrize("messages,match", [
    (USER + [{"role": "tool", "tool_call_id": "call_x", "content": "r"}], "answers no tool call"),
    (USER + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": "{not json"}}]}], "arguments must be a JSON object"),
    (HISTORY[:2] + [{"role": "tool", "content": "r"}], "needs tool_call_id"),
])
def test_bad_tool_history_is_a_400(tools_server, messages, match):
    err = _error(_post(tools_server, {"messages": messages}), "messages")
    assert match in err["message"]


def test_auto_tool_choice_needs_the_server_flag(api_server):
    for extra in ({"tool_choice": "auto"}, {}):  # omitted: "auto" with tools, as OpenAI's default
        err = _error(_post(api_server, {"messages": USER, "tools": [WEATHER], **extra}), "tool_choice")
        assert "--enable-auto-tool-choice" in err["message"]


@pytest.mark.parametrize("extra,param,match", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "must describe an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "JSON schema object"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "not unique"),
    ({"tools": {"get_weather": {}}}, "tools", None),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"tools": [WEATHER], "tool_choice": "required", "use_beam_search": True, "n": 2}, "tool_choice", "beam"),
])
def test_bad_tool_requests_are_400s(tools_server, extra, param, match):
    err = _error(_post(tools_server, {"messages": USER, **extra}), param)
    if match:
        assert match in err["message"], err


# ----------------------------------------------------------------------------- grammar-enforced calls

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Berlin") and args["days"] in (1, 2, 3) and set(args) == {"city", "days"}
    return args


def test_named_tool_choice_gives_that_call(tools_client):
    out = tools_client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED,
                                               max_tokens=100, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _check_weather_args(call.function.arguments)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_of_known_tools(tools_client, parallel):
    # seed 2: the tiny random model makes several calls when it may (checked: it ends the array)
    out = tools_client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                               parallel_tool_calls=parallel, max_tokens=400, temperature=1.0, seed=2)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert len(choice.message.tool_calls) > 1 if parallel else len(choice.message.tool_calls) == 1
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    for call in choice.message.tool_calls:
        if call.function.name == "get_weather":
            _check_weather_args(call.function.arguments)
        else:
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("CET", "UTC")


def test_streamed_tool_calls_are_reassembled_by_the_client(tools_client):
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=100, temperature=0)
    whole = tools_client.chat.completions.create(**kwargs).choices[0]
    with tools_client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    chunks = list(tools_client.chat.completions.create(stream=True, **{**kwargs, "tool_choice": "required",
                                                                       "parallel_tool_calls": False}))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args: dict[int, str] = {}
    for d in deltas:
        if d.id is not None:
            assert d.type == "function" and d.function.name and d.function.arguments == "" and d.index not in args
            args[d.index] = ""
        else:
            assert d.function.name is None and d.type is None
            args[d.index] += d.function.arguments
    assert args and all(json.loads(a) is not None for a in args.values())


def test_raw_stream_deltas_have_openais_shape(tools_server):
    with httpx.stream("POST", tools_server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": NAMED,
                            "max_tokens": 100, "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    per_chunk = [e["choices"][0]["delta"]["tool_calls"] for e in events
                 if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    assert all(len(calls) == 1 for calls in per_chunk)  # one call here: one entry per chunk
    tool_deltas = [calls[0] for calls in per_chunk]
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    _check_weather_args("".join(d["function"]["arguments"] for d in rest))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_round_trip_end_to_end(tools_client):
    """The model calls a tool, the tool's result goes back, the model answers in plain content."""
    first = tools_client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=NAMED,
                                                 max_tokens=100, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = USER + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = tools_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=5, temperature=0, extra_body={"chat_template": TOOL_TEMPLATE})
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content is not None
    assert final.usage.prompt_tokens > 40  # the call and its result are in the prompt


HERMES_REGEX = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Berlin)", "days": [123]\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_a_hermes_call(tools_client, stream):
    """tool_choice "auto": the output (held to a Hermes call by a regex) is parsed into a call."""
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="auto", max_tokens=100, temperature=0,
                  extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    if stream:
        with tools_client.chat.completions.stream(**kwargs) as s:
            choice = s.get_final_completion().choices[0]
    else:
        choice = tools_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_weather_args(call.function.arguments)


def test_a_tool_schema_the_grammar_cannot_compile_is_a_400_naming_tools(tools_server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        _error(_post(tools_server, {"messages": USER, "tools": [bad], "tool_choice": choice}), "tools")


def test_each_choice_gets_its_own_calls(tools_server):
    r = _post(tools_server, {"messages": USER, "tools": [WEATHER], "tool_choice": NAMED, "n": 2, "max_tokens": 100,
                             "temperature": 1.0, "seed": 3, "stream": False})
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] == "tool_calls" for c in choices)
    ids = [c["message"]["tool_calls"][0]["id"] for c in choices]
    assert len(set(ids)) == 2
    for c in choices:
        _check_weather_args(c["message"]["tool_calls"][0]["function"]["arguments"])


def _stream_calls(server, body: dict) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) reassembled from the raw stream's deltas."""
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "temperature": 0, **body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content, calls, finish = "", {}, None
    for e in events:
        choice = e["choices"][0]
        content += choice["delta"].get("content") or ""
        for d in choice["delta"].get("tool_calls") or []:
            if "id" in d:
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                calls[d["index"]][1] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_tool_calls_cut_by_max_tokens_are_partial_calls_with_finish_reason_length(tools_server, tool_choice):
    """Cut off by max_tokens, "required" and a named function answer as OpenAI does, streamed or
    not: `tool_calls` holds the calls as far as they go (the last one's arguments the JSON text so
    far), content is null, finish_reason is "length" (never "tool_calls")."""
    base = {"messages": USER, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
            "tool_choice": NAMED if tool_choice == "named" else tool_choice}
    full = _post(tools_server, {**base, "max_tokens": 100}).json()
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    (whole,) = [(c["function"]["name"], c["function"]["arguments"]) for c in full["choices"][0]["message"]["tool_calls"]]
    n = full["usage"]["completion_tokens"]
    partial_seen = False
    for cut in sorted({1, 2, n // 3, n // 2, 2 * n // 3, n - 2, n - 1}):
        choice = _post(tools_server, {**base, "max_tokens": cut}).json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, (cut, choice)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
        assert len(calls) <= 1, (cut, calls)
        if tool_choice == "named":
            assert len(calls) == 1  # the name is known before the first argument token
        for name, arguments in calls:
            assert name == whole[0] and whole[1].startswith(arguments), (cut, calls, whole)
            partial_seen = partial_seen or (arguments != whole[1] and len(arguments) > 2)
        content, streamed, finish = _stream_calls(tools_server, {**base, "max_tokens": cut})
        assert (content, streamed, finish) == ("", calls, "length"), (cut, streamed, calls)
    assert partial_seen  # some cut fell inside the arguments: a prefix that is not yet JSON


def test_the_official_client_reads_a_cut_off_named_call(tools_client):
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=NAMED, temperature=0)
    whole = tools_client.chat.completions.create(max_tokens=100, **kwargs).choices[0].message.tool_calls[0]
    choice = tools_client.chat.completions.create(max_tokens=6, **kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert whole.function.arguments.startswith(call.function.arguments) and call.function.arguments != whole.function.arguments
