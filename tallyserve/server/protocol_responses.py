"""POST /v1/responses (OpenAI's Responses API): the request model, its input items as chat
messages, its function tools in chat form, and the response objects and stream events.

Nothing is stored: `store` omitted or false is accepted (the response says `"store": false`);
`store: true`, `previous_response_id`, `conversation` and `background` are 400s naming the field.
Fields of OpenAI's request that tallyserve does not implement are 400s unless absent, null or a
harmless value (as the chat catalogue in fields.py); fields OpenAI does not define are ignored."""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional, Union

from pydantic import ConfigDict, field_validator

from tallyserve.server.errors import bad_request
from tallyserve.server.protocol import RequestModel, check_metadata, now


def response_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: Optional[str] = None
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[Any] = None  # OpenAI's limits (protocol.check_metadata); echoed in the response
    user: Optional[str] = None
    text: Optional[dict[str, Any]] = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Any) -> Optional[dict[str, str]]:
        return check_metadata(value)


# OpenAI request fields tallyserve does not implement: (why, harmless values besides null).
_ANY = object()  # any value is harmless (an identifier or hint that changes no output)
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "background": ("responses run in the foreground only", (False,)),
    "conversation": ("responses are not stored, so there are no conversations", ()),
    "prompt": ("there are no stored prompt templates", ()),
    "reasoning": ("there is no reasoning control", ({},)),
    "truncation": ("the input is never truncated", ("disabled",)),
    "include": ("there is nothing extra to include", ([],)),
    "top_logprobs": ("logprobs are not returned by /v1/responses", (0,)),
    "max_tool_calls": ("the number of calls is not limited", ()),
    "service_tier": ("there are no service tiers", ("auto", "default")),
    "prompt_cache_key": ("a caching hint: prefix caching is automatic", (_ANY,)),
    "safety_identifier": ("an end-user identifier: changes no output", (_ANY,)),
    "stream_options": ("stream options change nothing here", (_ANY,)),
}


def check_request(req: ResponsesRequest) -> None:
    """400s for what this server cannot do."""
    if req.store:
        raise bad_request("responses are not stored by tallyserve: omit store or send false", "store",
                          "unsupported_parameter")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: responses are not stored; send the whole "
                          "conversation as input items", "previous_response_id", "unsupported_parameter")
    for name, value in (req.model_extra or {}).items():
        if name not in UNSUPPORTED or value is None:
            continue
        why, harmless = UNSUPPORTED[name]
        if _ANY in harmless or any(json.dumps(value, sort_keys=True) == json.dumps(h, sort_keys=True) for h in harmless):
            continue
        raise bad_request(f"{name} is not supported by tallyserve: {why}", name, "unsupported_parameter")


def text_format(req: ResponsesRequest) -> Optional[dict]:
    """The JSON schema of `text.format` ({"type": "json_schema", "schema": ...}), {} for
    {"type": "json_object"}, None for plain text."""
    fmt = (req.text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return fmt["schema"]
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {}
    raise bad_request("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")


# ----------------------------------------------------------------------------- input -> chat


def chat_tools(tools: Optional[list[Any]]) -> Optional[list[Any]]:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) in chat form."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(f"tools[{i}] of type {json.dumps(kind)[:60]} is not supported: only function tools",
                              "tools", "unsupported_parameter")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{j}] must be one of {', '.join(kinds)} with text; got "
                              f"{json.dumps(kind)[:60]} (only text input is supported)", "input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def input_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages: message items by role (developer as system),
    function_call items as the assistant's tool_calls, function_call_output items as tool results."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise bad_request("input must be a non-empty string or list of items", "input")
    calls_open = False  # the previous item was the assistant's (a message or a call)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", "input")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_parts(item.get("content"), where, kinds)})
            calls_open = role == "assistant"
        elif kind == "function_call":
            fields = [item.get(k) for k in ("call_id", "name", "arguments")]
            if not all(isinstance(f, str) for f in fields):
                raise bad_request(f"{where} (function_call) needs call_id, name and arguments strings", "input")
            call = {"id": fields[0], "type": "function", "function": {"name": fields[1], "arguments": fields[2]}}
            if calls_open:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls_open = True
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs a call_id string", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_parts(output, where, ("input_text", "output_text"))})
            calls_open = False
        else:
            raise bad_request(f"{where}.type {json.dumps(kind)[:60]} is not supported: send message, function_call "
                              "or function_call_output items", "input", "unsupported_parameter")
    return messages


# ----------------------------------------------------------------------------- output objects


def message_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, status: str,
                    output: list[dict], usage: Optional[dict] = None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": now() if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }


def usage_object(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}
