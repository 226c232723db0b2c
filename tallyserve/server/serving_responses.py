"""POST /v1/responses: OpenAI's Responses API over the chat template, stateless.

The input (a string, or message / function_call / function_call_output items, plus
`instructions`) becomes chat messages; function tools and tool_choice work as in chat
completions (serving_tools.py); the output is a `message` item with `output_text` content and/or
`function_call` items. With `stream: true` the events are OpenAI's: response.created,
response.in_progress, then per item output_item.added, (content_part.added, output_text.delta...,
output_text.done, content_part.done | function_call_arguments.delta..., .done), output_item.done,
and response.completed (response.incomplete when max_output_tokens cut it), each with a
sequence_number."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from tallyserve.engine.async_engine import EngineDeadError, StepFailedError
from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tallyserve.server.errors import bad_request
from tallyserve.server.protocol import now
from tallyserve.server.protocol_responses import (ResponsesRequest, chat_tool_choice, chat_tools, check_request,
                                                  function_call_item, input_messages, message_item, output_text_part,
                                                  response_id, response_object, text_format, usage_object)
from tallyserve.server.serving import (ServerContext, check_admission, check_model, check_prompt_ids, collect, merged,
                                       prime, text_size, tokenize, tracked)
from tallyserve.server.serving_chat import template_error
from tallyserve.server.structured import CONSTRAINT_FIELD
from tallyserve.server.serving_tools import ChoiceTools, ToolPlan, plan_tools, with_tool_constraints
from tallyserve.server.sse import ChoiceProgress, SSEResponse
from tallyserve.server import errors


def _params(req: ResponsesRequest, plan: Optional[ToolPlan]) -> SamplingParams:
    try:
        params = SamplingParams(n=1, temperature=1.0 if req.temperature is None else req.temperature,
                                top_p=1.0 if req.top_p is None else req.top_p, max_tokens=req.max_output_tokens)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc).replace("max_tokens", "max_output_tokens"),
                          "max_output_tokens" if field == "max_tokens" else field) from exc
    schema = text_format(req)
    if schema is not None:
        if plan is not None and plan.schema is not None:
            raise bad_request("text.format cannot be combined with tool_choice 'required' or a named function",
                              "text.format")
        so = StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True)
        params = replace(params, structured_outputs=so)
        CONSTRAINT_FIELD.set("text.format")  # a schema that does not compile is a 400 naming it
    return with_tool_constraints(params, plan)


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request):
    check_model(ctx, req.model)
    check_request(req)
    tools = chat_tools(req.tools)
    plan = plan_tools(ctx, tools, chat_tool_choice(req.tool_choice), req.parallel_tool_calls)
    params = _params(req, plan)
    messages = input_messages(req)
    if ctx.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it has no chat template", "input")
    template_tools = plan.template_tools if plan is not None else None
    try:
        ids = await tokenize(ctx, text_size(messages) + text_size(tools), lambda tok: tok.apply_chat_template(
            messages, tools=template_tools))
    except ValueError as exc:
        err = template_error(exc)
        err.param = "input" if err.param == "messages" else err.param
        raise err from exc
    check_prompt_ids(ctx, ids, params, "input")
    check_admission(ctx)
    rid = response_id("resp")
    gens = [tracked(ctx, rid, {"prompt_token_ids": ids}, params)]
    if req.stream:
        stream = await prime(raw, merged(gens))
        return SSEResponse(_stream(ctx, req, rid, stream, plan), stream)
    out = (await collect(raw, gens))[0]
    return JSONResponse(_response(ctx, req, rid, out, plan))


def _stream_error(exc: BaseException) -> errors.APIError:
    if isinstance(exc, errors.APIError):
        return exc
    if isinstance(exc, StepFailedError):
        return errors.step_failed(str(exc))
    if isinstance(exc, EngineDeadError):
        return errors.unavailable(str(exc), "engine_dead")
    return errors.APIError(500, f"{type(exc).__name__}: {exc}", errors.SERVER_ERROR, None, "internal_error")


def _status(finish_reason: Optional[str]) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _response(ctx: ServerContext, req: ResponsesRequest, rid: str, out: RequestOutput,
              plan: Optional[ToolPlan]) -> dict:
    o = out.outputs[0]
    content, calls, _ = ChoiceTools(plan).whole(o.text, o.finish_reason)
    output = []
    if content is not None or not calls:
        output.append(message_item(response_id("msg"), content or ""))
    for c in calls or []:
        output.append(function_call_item(response_id("fc"), c.id, c.function.name, c.function.arguments))
    usage = usage_object(len(out.prompt_token_ids), len(o.token_ids))
    return response_object(req, rid, ctx.served_model_name, now(), _status(o.finish_reason), output, usage)


class _Events:
    """Numbered server-sent events, and the output items as they open and close."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.output: list[dict] = []  # closed items
        self.message: Optional[dict] = None  # the open message item
        self.call: Optional[dict] = None  # the open function_call item

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def text(self, delta: str) -> list[str]:
        events = []
        if self.message is None:
            events += self.close_call()
            self.message = message_item(response_id("msg"), None, "in_progress")
            self.message["text"] = ""
            item = {k: v for k, v in self.message.items() if k != "text"}
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                     content_index=0, part=output_text_part("")))
        self.message["text"] += delta
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.output), content_index=0, delta=delta, logprobs=[]))
        return events

    def close_message(self) -> list[str]:
        if self.message is None:
            return []
        m, self.message = self.message, None
        text, index = m.pop("text"), len(self.output)
        item = message_item(m["id"], text)
        self.output.append(item)
        return [self.event("response.output_text.done", item_id=m["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                           part=output_text_part(text)),
                self.event("response.output_item.done", output_index=index, item=item)]

    def open_call(self, call_id: str, name: str) -> list[str]:
        events = self.close_message() + self.close_call()
        self.call = function_call_item(response_id("fc"), call_id, name, "", "in_progress")
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=dict(self.call)))
        return events

    def arguments(self, delta: str) -> list[str]:
        self.call["arguments"] += delta
        return [self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                           output_index=len(self.output), delta=delta)]

    def close_call(self) -> list[str]:
        if self.call is None:
            return []
        c, self.call = self.call, None
        c["status"], index = "completed", len(self.output)
        self.output.append(c)
        return [self.event("response.function_call_arguments.done", item_id=c["id"], output_index=index,
                           name=c["name"], arguments=c["arguments"]),
                self.event("response.output_item.done", output_index=index, item=c)]


async def _stream(ctx: ServerContext, req: ResponsesRequest, rid: str,
                  stream: AsyncIterator[tuple[int, RequestOutput]], plan: Optional[ToolPlan]) -> AsyncIterator[str]:
    ev, created, model = _Events(), now(), ctx.served_model_name
    progress, tools = ChoiceProgress(), ChoiceTools(plan)
    started = response_object(req, rid, model, created, "in_progress", [])
    yield ev.event("response.created", response=started)
    yield ev.event("response.in_progress", response=started)
    try:
        async for _, out in stream:
            o = out.outputs[0]
            if progress.finished:
                continue
            delta, _, _ = progress.advance(o)
            calls = []
            if tools.active:
                delta, calls = tools.delta(delta, progress.finished)
            for e in ev.text(delta) if delta else ():
                yield e
            for d in calls:
                for e in ev.open_call(d.id, d.function.name) if d.id is not None else ev.arguments(d.function.arguments):
                    yield e
            if progress.finished:
                if not ev.output and ev.message is None and ev.call is None:
                    for e in ev.text(""):
                        yield e
                for e in ev.close_message() + ev.close_call():
                    yield e
                status = _status(o.finish_reason)
                final = response_object(req, rid, model, created, status, ev.output,
                                        usage_object(len(out.prompt_token_ids), len(o.token_ids)))
                yield ev.event("response.completed" if status == "completed" else "response.incomplete",
                               response=final)
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        err = _stream_error(exc)
        yield ev.event("error", code=err.code or err.type, message=err.message, param=err.param)
    finally:
        await stream.aclose()
