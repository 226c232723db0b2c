"""POST /v1/chat/completions: messages through the model's chat template, one engine request
(or, with use_beam_search, one beam search group whose n best sequences are the choices).

vLLM's chat template controls: continue_final_message (the last message is rendered open and the
model continues it; add_generation_prompt then defaults to false, and both true is a 400),
chat_template / chat_template_kwargs (rendered in transformers' sandboxed Jinja; a template that
fails is a 400 naming chat_template), add_special_tokens, echo (the last message's content is
prepended to each choice when it is an assistant message, i.e. when its role is the response's)
and truncate_prompt_tokens (the last N template tokens are kept). Function tools (tools,
tool_choice, parallel_tool_calls) are in serving_tools.py."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.server.kv_transfer import add_to_body, check_params, prompt_with_params
from tallyserve.server.errors import QUOTE_LIMIT, bad_request, clip, quote
from tallyserve.server.logprobs import chat_logprobs
from tallyserve.server.prompt_logprobs import prompt_logprobs_field
from tallyserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatMessage, ChatStreamChoice, DeltaMessage,
                                        UsageInfo, now, random_id)
from tallyserve.server.serving import (INLINE_TOKENIZE_CHARS, ServerContext, check_admission, check_model,
                                       check_prompt_ids, check_unsupported, collect, merged, prime, sampling_params,
                                       text_size, tokenize, tracked)
from tallyserve.server.sse import SSE_DONE, ChoiceProgress, SSEResponse, chunk_sse, sse, stream_error_event
from tallyserve.server.serving_beam import BeamSpec, beam_spec, check_beam_fits, collect_beams
from tallyserve.server.serving_completion import truncation
from tallyserve.server.serving_tools import ChoiceTools, ToolPlan, chunk_groups, plan_tools, with_tool_constraints
from tallyserve.tokenizer import ChatTemplateError, normalise_messages

MESSAGE_QUOTE_CHARS = QUOTE_LIMIT + 200  # a chat template error: its own words plus what it quotes


def _check_request(ctx: ServerContext, req: ChatCompletionRequest
                   ) -> tuple[Union[SamplingParams, BeamSpec], Optional[ToolPlan]]:
    check_model(ctx, req.model)
    check_unsupported(req)  # the field catalogue: response_format, vLLM extras, ...
    plan = plan_tools(ctx, req.tools, req.tool_choice, req.parallel_tool_calls, bool(req.use_beam_search))
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    top = req.top_logprobs or 0
    if req.logprobs and not 0 <= top <= ctx.engine.max_logprobs:  # 20 (OpenAI's limit) unless --max-logprobs
        raise bad_request(f"top_logprobs must be in [0, {ctx.engine.max_logprobs}], got {quote(top)}", "top_logprobs")
    alias = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if req.use_beam_search:
        return beam_spec(req, req.effective_max_tokens, alias, logprobs=bool(req.logprobs)), plan
    params = sampling_params(req, req.effective_max_tokens, top if req.logprobs else None, alias, ctx=ctx)
    return with_tool_constraints(params, plan), plan


def chat_controls(req: Any, ctx: ServerContext) -> dict[str, Any]:
    """The chat template arguments of a chat (or /tokenize) request, with vLLM's rule for the two
    flags: add_generation_prompt defaults to true, but to false when continue_final_message is set
    and add_generation_prompt is not sent; both sent true is a 400 (render_chat raises it). A
    request's own chat_template runs only on a server started with --trust-request-chat-template:
    the sandbox stops escapes, not a template built to loop for minutes on the tokenizer thread."""
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request("chat_template in the request is refused by this server: it renders only its own "
                          "template unless started with --trust-request-chat-template", "chat_template",
                          "unsupported_parameter")
    cont = bool(req.continue_final_message)
    if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt is not None:
        add = bool(req.add_generation_prompt)
    else:
        add = not cont
    return dict(add_generation_prompt=add, continue_final_message=cont, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs)


def template_size(req: Any) -> int:
    """The cost of rendering: the messages' text, or, for a request's own chat template (whose
    running time the server cannot bound), enough to render it off the event loop."""
    size = text_size(req.messages) + text_size(getattr(req, "tools", None))
    if req.chat_template is not None:
        size += INLINE_TOKENIZE_CHARS + len(req.chat_template)
    return size


def template_error(exc: ValueError) -> Exception:
    """A chat template (or message) failure as a 400 naming the field to blame."""
    param = exc.param if isinstance(exc, ChatTemplateError) else "messages"
    return bad_request(clip(str(exc), MESSAGE_QUOTE_CHARS), param)  # it may quote the messages: keep it short


async def _prompt_ids(ctx: ServerContext, req: ChatCompletionRequest, plan: Optional[ToolPlan]) -> list[int]:
    """The chat template's token ids (large conversations are rendered off the event loop)."""
    if ctx.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it has no chat template; use /v1/completions "
                          "with token ids", "messages")
    messages, controls, special = req.messages, chat_controls(req, ctx), bool(req.add_special_tokens)
    tools = plan.template_tools if plan is not None else None
    try:
        return await tokenize(ctx, template_size(req), lambda tok: tok.apply_chat_template(
            messages, add_special_tokens=special, tools=tools, **controls))
    except ValueError as exc:
        raise template_error(exc) from exc


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when its role is the response's (assistant)."""
    if not req.echo or req.messages[-1].get("role") != "assistant":
        return ""
    last = normalise_messages(req.messages[-1:])[0]  # already validated by the template render
    return last["content"] or ""


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    params, plan = _check_request(ctx, req)
    keep = truncation(ctx, req.truncate_prompt_tokens)
    ids = await _prompt_ids(ctx, req, plan)
    if keep is not None:
        ids = ids[-keep:]
    check_prompt_ids(ctx, ids, params, "messages")
    if isinstance(params, BeamSpec):
        check_beam_fits(ctx, params, len(ids))
    kv_params = check_params(ctx, req.kv_transfer_params, [len(ids)], req.n or 1)
    check_admission(ctx)
    request_id = random_id("chatcmpl")
    if isinstance(params, BeamSpec):
        out = (await collect_beams(ctx, raw, [(request_id, None, ids)], params))[0]
        return JSONResponse(_response(ctx, req, request_id, out, plan).model_dump())
    gens = [tracked(ctx, request_id, prompt_with_params({"prompt_token_ids": ids}, kv_params), params)]
    if req.stream:
        stream = await prime(raw, merged(gens))
        return SSEResponse(_stream(ctx, req, request_id, params.n, stream, plan), stream)
    out = (await collect(raw, gens))[0]
    return JSONResponse(add_to_body(_response(ctx, req, request_id, out, plan).model_dump(), [out]))


def _response(ctx: ServerContext, req: ChatCompletionRequest, request_id: str,
              out: RequestOutput, plan: Optional[ToolPlan] = None) -> ChatCompletionResponse:
    choices, prefix = [], _echo_text(req)
    for o in out.outputs:
        lp = None
        if req.logprobs and o.logprobs is not None:
            lp = chat_logprobs(ctx.engine.tokenizer, o.token_ids, o.logprobs, req.top_logprobs or 0)
        content, calls, finish = ChoiceTools(plan).whole(o.text, o.finish_reason)
        if prefix:
            content = prefix + (content or "")
        choices.append(ChatChoice(index=o.index, message=ChatMessage(content=content, tool_calls=calls), logprobs=lp,
                                  finish_reason=finish))
    usage = UsageInfo.of(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs))
    scored = prompt_logprobs_field(out.prompt_logprobs, req.prompt_logprobs) if req.prompt_logprobs is not None else None
    return ChatCompletionResponse(id=request_id, model=ctx.served_model_name, choices=choices, usage=usage,
                                  prompt_logprobs=scored, metadata=req.metadata)


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, request_id: str, n: int,
                  stream: AsyncIterator[tuple[int, RequestOutput]], plan: Optional[ToolPlan] = None
                  ) -> AsyncIterator[str]:
    created, model, include_usage = now(), ctx.served_model_name, req.include_usage

    def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return chunk_sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]),
                         include_usage)

    progress = [ChoiceProgress() for _ in range(n)]
    tools = [ChoiceTools(plan) for _ in range(n)]
    last = None
    try:
        echo = _echo_text(req)  # in the first chunk of each choice
        for i in range(n):
            yield chunk(i, DeltaMessage(role="assistant", content=echo))
        async for _, out in stream:
            last = out
            for o in out.outputs:
                p = progress[o.index]
                if p.finished:
                    continue
                delta, ids, lps = p.advance(o)
                groups, t = [None], tools[o.index]
                if t.active:
                    delta, calls = t.delta(delta, p.finished)
                    groups = chunk_groups(calls) or [None]
                if delta or groups[0] or (req.logprobs and lps):
                    lp = chat_logprobs(ctx.engine.tokenizer, ids, lps, req.top_logprobs or 0) if req.logprobs and lps is not None else None
                    yield chunk(o.index, DeltaMessage(content=delta or None if groups[0] else delta, tool_calls=groups[0]), lp)
                for group in groups[1:]:
                    yield chunk(o.index, DeltaMessage(tool_calls=group))
                if p.finished:
                    yield chunk(o.index, DeltaMessage(), finish_reason=t.finish_reason(o.finish_reason))
        if include_usage and last is not None:
            usage = UsageInfo.of(len(last.prompt_token_ids), sum(len(o.token_ids) for o in last.outputs))
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield stream_error_event(exc)
    finally:
        await stream.aclose()  # a client that hung up: abort what still runs, now
    yield SSE_DONE
