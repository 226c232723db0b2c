"""POST /tokenize and POST /detokenize, in vLLM's shapes: the served model's tokenizer (and chat
template) without running the engine. Large inputs are tokenized or decoded on the server's
tokenizer thread, like the prompts of the completion routes."""

from __future__ import annotations

from typing import Any, Optional

from fastapi.responses import JSONResponse

from tallyserve.server.errors import bad_request, clip, quote
from tallyserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from tallyserve.server.serving import ServerContext, check_model, tokenize
from tallyserve.server.serving_chat import MESSAGE_QUOTE_CHARS, chat_controls, template_error, template_size
from tallyserve.tool_specs import ToolSpecError, parse_tools


def _tokenizer_or_400(ctx: ServerContext, param: str) -> None:
    if ctx.engine.tokenizer is None:
        raise bad_request("this model has no tokenizer", param)


def _token_strs(tok: Any, ids: list[int]) -> list[str]:
    return [s if s is not None else "" for s in tok.hf.convert_ids_to_tokens(ids)]


def _template_tools(tools: Optional[list[Any]]) -> Optional[list[dict]]:
    """The request's tools as the chat template receives them in a chat completion; 400 naming `tools`."""
    if tools is None:
        return None
    try:
        return [t.to_template() for t in parse_tools(tools)] or None
    except ToolSpecError as exc:
        raise bad_request(str(exc), exc.param) from exc


async def create_tokenize(ctx: ServerContext, req: TokenizeRequest) -> JSONResponse:
    check_model(ctx, req.model)
    if req.prompt is None and req.messages is None:
        raise bad_request("send either `prompt` (text) or `messages` (chat messages) to tokenize", "prompt")
    if req.prompt is not None and req.messages is not None:
        raise bad_request("send either `prompt` or `messages`, not both", "messages")
    if req.prompt is not None and req.tools is not None:
        raise bad_request("tools go into the chat template: send them with `messages`, not `prompt`", "tools")
    param = "prompt" if req.prompt is not None else "messages"
    _tokenizer_or_400(ctx, param)
    want_strs = bool(req.return_token_strs)

    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False  # default true

        def run(tok: Any) -> tuple[list[int], Optional[list[str]]]:
            ids = tok.encode(text, add_special_tokens=special)
            return ids, _token_strs(tok, ids) if want_strs else None
        size = len(text)
    else:
        messages, controls = req.messages, chat_controls(req, ctx)  # vLLM's chat template controls
        special = bool(req.add_special_tokens)  # default false: the template places its own
        tools = _template_tools(req.tools)

        def run(tok: Any) -> tuple[list[int], Optional[list[str]]]:
            # exactly what /v1/chat/completions sends to the engine
            ids = tok.apply_chat_template(messages, add_special_tokens=special, tools=tools, **controls)
            return ids, _token_strs(tok, ids) if want_strs else None
        size = template_size(req)
    try:
        ids, strs = await tokenize(ctx, size, run)
    except ValueError as exc:  # a bad message or template error; it may quote the input: keep it short
        if req.messages is not None:
            raise template_error(exc) from exc
        raise bad_request(clip(str(exc), MESSAGE_QUOTE_CHARS), param) from exc
    body = TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(body.model_dump())


async def create_detokenize(ctx: ServerContext, req: DetokenizeRequest) -> JSONResponse:
    check_model(ctx, req.model)
    _tokenizer_or_400(ctx, "tokens")
    ids = req.tokens
    if ids:
        vocab = ctx.engine.vocab_size
        for t in (min(ids), max(ids)):
            if not 0 <= t < vocab:
                raise bad_request(f"token id {quote(t)} is out of range [0, {vocab})", "tokens")
    # Special tokens are kept, as vLLM's /detokenize does: the ids come back as the text they are.
    text = await tokenize(ctx, len(ids), lambda tok: tok.decode(ids, skip_special_tokens=False))
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
