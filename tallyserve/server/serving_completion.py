"""POST /v1/completions: one engine request per prompt, n choices each (choice index = prompt * n + i).
With use_beam_search, one beam search group per prompt whose n best sequences are the choices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.server.kv_transfer import add_to_body, check_params, prompt_with_params
from tallyserve.server.errors import bad_request, quote
from tallyserve.server.logprobs import completion_logprobs
from tallyserve.server.prompt_logprobs import echo_logprobs, extend, prompt_logprobs_field, scored
from tallyserve.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse,
                                        CompletionStreamResponse, UsageInfo, now, random_id)
from tallyserve.server.serving import (ServerContext, check_admission, check_model, check_prompt_ids,
                                       check_unsupported, collect, merged, prime, sampling_params, text_size, tokenize,
                                       tracked)
from tallyserve.server.sse import SSE_DONE, ChoiceProgress, SSEResponse, chunk_sse, sse, stream_error_event
from tallyserve.server.serving_beam import BeamSpec, beam_spec, check_beam_fits, collect_beams

MAX_PROMPTS = 2048  # OpenAI's limit on prompts per request


def truncation(ctx: ServerContext, value: Optional[int]) -> Optional[int]:
    """vLLM's truncate_prompt_tokens: how many prompt tokens to keep (the last ones), or None for
    all. -1 means max_model_len; a value above max_model_len is a 400, as in vLLM."""
    if value is None:
        return None
    max_len = ctx.engine.max_model_len
    if value == -1:
        return max_len
    if value < 1:
        raise bad_request(f"truncate_prompt_tokens must be at least 1 (or -1 for max_model_len), got {quote(value)}",
                          "truncate_prompt_tokens")
    if value > max_len:
        raise bad_request(f"truncate_prompt_tokens ({value}) is greater than max_model_len ({max_len}); "
                          "send a smaller value, or -1 for max_model_len", "truncate_prompt_tokens")
    return value


@dataclass
class _Prompt:
    text: Optional[str]
    ids: list[int]

    def echo_text(self, ctx: ServerContext) -> str:
        if self.text is not None:
            return self.text
        tok = ctx.engine.tokenizer
        return tok.decode(self.ids, skip_special_tokens=False) if tok is not None else ""


async def _prompts(ctx: ServerContext, prompt, add_special_tokens: bool = True,
                   keep: Optional[int] = None) -> list[_Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> prompts with token ids (large texts are
    tokenized off the event loop). `keep`: truncate_prompt_tokens (left truncation); a truncated
    text prompt is echoed as the text of the tokens kept."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if ctx.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
        ids = await tokenize(ctx, text_size(texts),
                             lambda tok: [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts])
        items = [_Prompt(t, i) for t, i in zip(texts, ids)]
    elif prompt and isinstance(prompt[0], int):
        items = [_Prompt(None, list(prompt))]
    else:
        items = [_Prompt(None, list(ids)) for ids in prompt]
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    if keep is not None:
        items = [p if len(p.ids) <= keep else _Prompt(None, p.ids[-keep:]) for p in items]
    return items


def _check_request(ctx: ServerContext, req: CompletionRequest) -> Union[SamplingParams, BeamSpec]:
    check_model(ctx, req.model)
    check_unsupported(req)  # the field catalogue: suffix, prompt_embeds, guided decoding, vLLM extras, ...
    if req.use_beam_search:
        return beam_spec(req, req.max_tokens, "max_tokens", logprobs=req.logprobs is not None)
    if req.logprobs is not None and req.logprobs > ctx.engine.max_logprobs:
        raise bad_request(f"logprobs must be at most {ctx.engine.max_logprobs}, got {quote(req.logprobs)}", "logprobs")
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise bad_request("max_tokens must be at least 1; 0 is accepted only with echo=true (the prompt "
                              "scored, nothing generated)", "max_tokens")
        max_tokens = 1  # one token is generated and dropped: the response is the prompt alone
    params = sampling_params(req, max_tokens, req.logprobs, ctx=ctx)
    if req.echo and req.logprobs is not None:  # the echoed prompt carries its logprobs too
        params = params.clone(prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
    return params


def _prompt_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt and its logprobs, no generation (lm-evaluation-harness's
    loglikelihood requests)."""
    return bool(req.echo) and req.max_tokens == 0


def _finish_reason(req: CompletionRequest, reason: Optional[str]) -> Optional[str]:
    """A prompt-only request ends by length: the token generated to end it is dropped."""
    return "length" if _prompt_only(req) and reason in ("stop", "length") else reason


def _choice_logprobs(ctx: ServerContext, req: CompletionRequest, prompt: "_Prompt", out: RequestOutput,
                     ids, lps, text_offset: int, with_prompt: bool):
    """The logprobs of one choice (or of one streamed chunk of it): with echo, those of the prompt
    first; then those of ``ids`` (none for a prompt-only request). Returns them and the next offset."""
    tok = ctx.engine.tokenizer
    head = None
    if with_prompt and req.echo:
        head, text_offset = echo_logprobs(tok, prompt.ids, out.prompt_logprobs, req.logprobs)
    if _prompt_only(req) or lps is None:
        return head, text_offset
    tail, text_offset = completion_logprobs(tok, ids, lps, req.logprobs, text_offset)
    return (extend(head, tail) if head is not None else tail), text_offset


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request):
    params = _check_request(ctx, req)
    keep = truncation(ctx, req.truncate_prompt_tokens)
    prompts = await _prompts(ctx, req.prompt, req.add_special_tokens is not False, keep)
    for p in prompts:
        check_prompt_ids(ctx, p.ids, params, "prompt")
        if isinstance(params, BeamSpec):
            check_beam_fits(ctx, params, len(p.ids))
    kv_params = check_params(ctx, req.kv_transfer_params, [len(p.ids) for p in prompts], req.n or 1)
    check_admission(ctx)
    request_id = random_id("cmpl")
    if isinstance(params, BeamSpec):
        outs = await collect_beams(ctx, raw, [(f"{request_id}-{i}", p.text, p.ids) for i, p in enumerate(prompts)],
                                   params)
        return JSONResponse(_response(ctx, req, request_id, prompts, outs).model_dump())
    gens = [tracked(ctx, f"{request_id}-{i}", prompt_with_params({"prompt": p.text, "prompt_token_ids": p.ids},
                                                                kv_params), params)
            for i, p in enumerate(prompts)]
    if req.stream:
        stream = await prime(raw, merged(gens))
        return SSEResponse(_stream(ctx, req, request_id, prompts, params.n, stream), stream)
    outs = await collect(raw, gens)
    return JSONResponse(add_to_body(_response(ctx, req, request_id, prompts, outs).model_dump(), outs))


def _response(ctx: ServerContext, req: CompletionRequest, request_id: str, prompts: list[_Prompt],
              outs: list[RequestOutput]) -> CompletionResponse:
    choices, completion_tokens = [], 0
    n = req.n or 1
    prompt_only = _prompt_only(req)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        prefix = prompt.echo_text(ctx) if req.echo else ""
        prompt_field = prompt_logprobs_field(out.prompt_logprobs, req.prompt_logprobs) \
            if req.prompt_logprobs is not None else None
        for o in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp, _ = _choice_logprobs(ctx, req, prompt, out, o.token_ids, o.logprobs, len(prefix), True)
            text = prefix if prompt_only else prefix + o.text
            choices.append(CompletionChoice(index=i * n + o.index, text=text, logprobs=lp,
                                            finish_reason=_finish_reason(req, o.finish_reason),
                                            prompt_logprobs=prompt_field))
            completion_tokens += 0 if prompt_only else len(o.token_ids)
    choices.sort(key=lambda c: c.index)
    usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in outs), completion_tokens)
    return CompletionResponse(id=request_id, model=ctx.served_model_name, choices=choices, usage=usage,
                              metadata=req.metadata)


async def _stream(ctx: ServerContext, req: CompletionRequest, request_id: str, prompts: list[_Prompt], n: int,
                  stream: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    created, model, include_usage = now(), ctx.served_model_name, req.include_usage
    progress = [ChoiceProgress() for _ in range(len(prompts) * n)]
    last: dict[int, RequestOutput] = {}
    prompt_only = _prompt_only(req)
    echo_scored = bool(req.echo) and req.logprobs is not None
    try:
        async for i, out in stream:
            last[i] = out
            for o in out.outputs:
                p = progress[i * n + o.index]
                if p.finished:
                    continue
                if echo_scored and not p.started and not o.finish_reason and not scored(out):
                    continue  # the first chunk waits for the whole prompt's logprobs (outputs are cumulative)
                delta, ids, lps = p.advance(o)
                if prompt_only:  # one chunk, once the dropped token is in: the prompt alone
                    if not p.finished:
                        continue
                    delta = ""
                elif not delta and not p.finished and not (lps and req.logprobs is not None) \
                        and ctx.engine.tokenizer is not None:  # no tokenizer: every token is an (empty) chunk
                    continue
                if req.echo and not p.started:
                    delta = prompts[i].echo_text(ctx) + delta
                lp = None
                if req.logprobs is not None:  # the first chunk with echo carries the prompt's
                    lp, p.text_offset = _choice_logprobs(ctx, req, prompts[i], out, ids, lps, p.text_offset,
                                                         not p.started)
                p.started = True
                choice = CompletionChoice(index=i * n + o.index, text=delta, logprobs=lp,
                                          finish_reason=_finish_reason(req, o.finish_reason))
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice])
                yield chunk_sse(chunk, include_usage)
        if include_usage:
            usage = UsageInfo.of(sum(len(o.prompt_token_ids) for o in last.values()),
                                 0 if prompt_only else sum(len(c.token_ids) for o in last.values() for c in o.outputs))
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield stream_error_event(exc)
    finally:
        await stream.aclose()  # a client that hung up: abort what still runs, now
    yield SSE_DONE
