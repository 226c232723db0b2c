"""Function tools over /v1/chat/completions: definitions reach the chat template, tool_choice
"none" / "auto" (with --enable-auto-tool-choice and the hermes parser) / "required" / a named
function (grammar-enforced), tool-call history, OpenAI's streamed tool-call deltas (reassembled by
the official client), and the 400s."""

from __future__ import annotations

import json

import httpx
import openai
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
