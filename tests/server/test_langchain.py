"""LangChain's ChatOpenAI against tallyserve (the tools server: ChatML model, hermes parser):
forced tool calls through bind_tools, and with_structured_output in its three methods. The
grammar (structured outputs) holds the tiny random model to the schemas."""

from __future__ import annotations

from typing import Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.live_server import API_KEY, MODEL

langchain_openai = pytest.importorskip("langchain_openai")


class Weather(BaseModel):
    """The weather forecast to look up."""

    city: Literal["Paris", "Berlin"]
    days: Literal[1, 2, 3]


class Notes(BaseModel):
    """Any JSON object (json_mode promises an object, not a schema)."""

    model_config = ConfigDict(extra="allow")
    title: Optional[str] = None


@pytest.fixture(scope="module")
def chat(tools_server):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=tools_server.base_url + "/v1", api_key=API_KEY,
                                       temperature=0, max_tokens=200, max_retries=0, timeout=120)


@pytest.mark.parametrize("tool_choice", ["Weather", "any", "required"])
def test_bind_tools_with_a_forced_choice_gives_a_valid_call(chat, tool_choice):
    # one call: greedy decoding of the tiny random model would repeat calls until max_tokens
    msg = chat.bind_tools([Weather], tool_choice=tool_choice, parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls, msg
    call = msg.tool_calls[0]
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    assert Weather(**call["args"])  # the arguments follow the schema
    assert msg.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_returns_the_model(chat, method):
    if method == "json_schema":  # a response_format schema allows free whitespace, which the tiny random model
        chat = chat.model_copy(update={"temperature": 1.0, "seed": 1})  # pads forever when greedy; seeded: it ends
    out = chat.with_structured_output(Weather, method=method).invoke("Weather in Berlin for two days?")
    assert isinstance(out, Weather)


def test_structured_output_json_mode_returns_a_parsed_object(chat):
    out = chat.with_structured_output(Notes, method="json_mode").invoke("Reply with a JSON object of notes.")
    assert isinstance(out, Notes)


def test_tool_round_trip_with_messages(chat):
    from langchain_core.messages import HumanMessage, ToolMessage

    first = chat.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Paris?")
    call = first.tool_calls[0]
    history = [HumanMessage("Weather in Paris?"), first, ToolMessage("sunny, 21 C", tool_call_id=call["id"])]
    final = chat.bind_tools([Weather], tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and not final.tool_calls
