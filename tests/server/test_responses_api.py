"""POST /v1/responses with the official openai client: string and item inputs, instructions,
max_output_tokens (status incomplete), usage, function tools with a tool round trip (function_call
and function_call_output items), the streamed event sequence, and the 400s of a stateless server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
                          "required": ["city"], "additionalProperties": False}}


def test_create_with_a_string_input(client, offline):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=5, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    # the same tokens as chat: the prompt is the chat template of one user message
    from tallyserve import SamplingParams
    ref = offline.chat([{"role": "user", "content": "Hello there"}], SamplingParams(max_tokens=5, temperature=0))[0]
    assert r.output_text == ref.outputs[0].text
    assert r.usage.input_tokens == len(ref.prompt_token_ids)
    assert r.usage.output_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Count to a hundred", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_items_and_instructions_reach_the_template(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "message", "role": "user", "content": "Bye"}]
    short = client.responses.create(model=MODEL, input=items, max_output_tokens=1, temperature=0)
    longer = client.responses.create(model=MODEL, input=items, instructions="Answer in French, briefly.",
                                     max_output_tokens=1, temperature=0)
    assert longer.usage.input_tokens > short.usage.input_tokens + 5
    assert longer.instructions == "Answer in French, briefly."


def test_tool_round_trip_items(client):
    """function_call and function_call_output items from an earlier turn, then a plain answer."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=3,
                                temperature=0)
    assert r.output[0].type == "message" and r.tools[0].name == "get_weather"
    bad = items[:1] + [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=bad, max_output_tokens=3)
    assert "answers no tool call" in str(e.value)


def _input_that_stops(offline) -> str:
    """An input the tiny model answers with EOS within 30 tokens (greedy), so the response completes."""
    from tallyserve import SamplingParams

    for text in ("Paris", "No", "2", "Stop", "Hi", "b", "Hello"):
        out = offline.chat([{"role": "user", "content": text}], SamplingParams(max_tokens=30, temperature=0))[0]
        if out.outputs[0].finish_reason == "stop":
            return text
    raise AssertionError("no candidate input ends with EOS on this model")


def test_stream_event_sequence(client, offline):
    prompt = _input_that_stops(offline)
    events = list(client.responses.create(model=MODEL, input=prompt, max_output_tokens=30, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    whole = client.responses.create(model=MODEL, input=prompt, max_output_tokens=30, temperature=0)
    assert whole.output_text == text and whole.usage.output_tokens == final.usage.output_tokens
    assert final.status == whole.status == "completed"
    with client.responses.stream(model=MODEL, input=prompt, max_output_tokens=30, temperature=0) as s:
        assert s.get_final_response().output_text == text
    cut = list(client.responses.create(model=MODEL, input=prompt, max_output_tokens=1, temperature=0, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto needs --enable-auto-tool-choice on this server
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"model": "other"}, "model"),
])
def test_stateless_and_bad_requests_are_4xx(api_server, extra, param):
    r = httpx.post(api_server.base_url + "/v1/responses", headers=AUTH, timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra})
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_store_false_and_omitted_are_accepted(api_server):
    for extra in ({}, {"store": False}, {"include": [], "truncation": "disabled", "service_tier": "auto"}):
        r = httpx.post(api_server.base_url + "/v1/responses", headers=AUTH, timeout=60,
                       json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra})
        assert r.status_code == 200 and r.json()["store"] is False, r.text


NAMED = {"type": "function", "name": "get_weather"}


def test_function_call_output_and_round_trip(client):
    """A forced call comes back as a function_call item; fed back with its output, the model answers."""
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED,
                                max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and json.loads(call.arguments)["city"] in ("Paris", "Berlin")
    follow = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    final = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=4, temperature=0)
    assert final.output[0].type == "message" and final.usage.input_tokens > r.usage.input_tokens


def test_required_tool_choice_and_streamed_function_call_events(client):
    kwargs = dict(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_output_tokens=80, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == done.arguments == events[-3].arguments == whole.output[0].arguments
    assert done.call_id == added.call_id and done.status == "completed"
    with client.responses.stream(**kwargs) as s:
        final = s.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", streamed)]


def test_text_format_json_schema_holds_the_output(client):
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}
    r = client.responses.create(model=MODEL, input="Yes or no?", text={"format": fmt}, max_output_tokens=20,
                                temperature=0)
    assert r.status == "completed" and json.loads(r.output_text) in ("yes", "no")
