"""What completions and chat completions share: admission checks, sampling params, prompt checks,
running engine requests (with metrics, merging and client-disconnect handling), SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Iterator, Optional, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tallyserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError, RequestRejectedError,
                                            StepFailedError)
from tallyserve.outputs import CompletionOutput, RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.server import errors
from tallyserve.server.errors import APIError, bad_request
from tallyserve.server.metrics import ServerMetrics
from tallyserve.server.protocol import SamplingFields

MAX_N = 128  # OpenAI's limit on n
T = TypeVar("T")


@dataclass
class ServerContext:
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    served_model_name: str
    api_key: Optional[str] = None
    enable_fault_injection: bool = False


class ClientDisconnected(Exception):
    pass


# ----------------------------------------------------------------------------- admission


def check_model(ctx: ServerContext, model: Optional[str]) -> None:
    if model is not None and model != ctx.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{ctx.served_model_name}`.",
                       errors.INVALID_REQUEST, "model", "model_not_found")


def check_admission(ctx: ServerContext) -> None:
    """503 while draining or with a dead loop; 429 when the waiting queue is full."""
    engine = ctx.engine
    if engine.draining:
        raise errors.unavailable("the server is shutting down and accepts no new requests", "draining")
    if not engine.is_running:
        raise errors.unavailable(engine.health().reason, "engine_dead")
    if engine.max_queue_len is not None and engine.num_waiting() >= engine.max_queue_len:
        raise APIError(429, f"too many requests waiting (max_queue_len is {engine.max_queue_len}); retry later",
                       errors.RATE_LIMIT, None, "queue_full")


def check_unsupported(req: SamplingFields) -> None:
    """400 for the OpenAI options tallyserve does not implement."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported; only 0 is accepted", name, "unsupported_parameter")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    n = 1 if req.n is None else req.n
    if n > MAX_N:
        raise bad_request(f"n must be at most {MAX_N}, got {n}", "n")


def sampling_params(req: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    check_unsupported(req)
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of other than n is only supported with use_beam_search (sampling returns "
                          "every sequence it draws)", "best_of", "unsupported_parameter")
    kwargs: dict[str, Any] = dict(
        n=n, temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, 0), min_p=_default(req.min_p, 0.0), seed=req.seed,
        max_tokens=max_tokens, min_tokens=_default(req.min_tokens, 0), stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=_default(req.ignore_eos, False), logprobs=logprobs,
        skip_special_tokens=_default(req.skip_special_tokens, True),
        include_stop_str_in_output=_default(req.include_stop_str_in_output, False),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        field = msg.split(" ", 1)[0].split("[", 1)[0]
        if field == "max_tokens":
            msg, field = msg.replace("max_tokens", max_tokens_param, 1), max_tokens_param
        raise bad_request(msg, field if field in kwargs or field == max_tokens_param else None) from exc


def _default(value: Optional[T], default: T) -> T:
    return default if value is None else value


def check_prompt_ids(ctx: ServerContext, ids: list[int], params: Any, param: str) -> None:
    """Range and length checks, so bad prompts are a 400 before they reach the engine. `params`:
    anything with `max_tokens` (SamplingParams, or beam search's BeamSpec)."""
    if not ids:
        raise bad_request("the prompt must not be empty", param)
    vocab = ctx.engine.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise bad_request(f"prompt token id {t} is out of range [0, {vocab})", param)
    limit = ctx.engine.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                          f"{len(ids)} tokens; it must be shorter.", param, "context_length_exceeded")
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} "
                          "for the completion). Please reduce the prompt or the completion length.",
                          "max_tokens", "context_length_exceeded")


# ----------------------------------------------------------------------------- running


async def tracked(ctx: ServerContext, request_id: str, prompt: dict, params: SamplingParams
                  ) -> AsyncIterator[RequestOutput]:
    """One engine request, its metrics recorded however it ends."""
    tracker = ctx.metrics.tracker()
    gen = ctx.engine.generate(request_id, prompt, params)
    try:
        async for out in gen:
            tracker.observe(out)
            yield out
    except (StepFailedError, EngineDeadError):
        tracker.finish("error")
        raise
    except RequestRejectedError:
        tracker.done = True  # never ran: a client error, not a finished request
        raise
    finally:
        await gen.aclose()  # aborts the request if it is still running
        tracker.finish("abort" if tracker.last is None or not tracker.last.finished else None)


async def merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the index of their request.
    Closing this iterator closes (and so aborts) every request still running."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                q.put_nowait((i, out, None))
            q.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await q.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


async def until_disconnect(raw: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(raw: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run requests to the end (non-streaming); map engine failures to API errors."""
    async def run() -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for i, out in merged(gens):
            final[i] = out
        return [final[i] for i in range(len(gens))]
    with engine_errors():
        return await until_disconnect(raw, run())


async def prime(raw: Request, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first item before the response starts, so a rejected request still gets a
    proper status; a step failure at this point is left to the stream (an error event)."""
    try:
        with engine_errors(step_failures=False):
            first = await until_disconnect(raw, stream.__anext__())
    except StopAsyncIteration:
        return _empty()
    except StepFailedError as exc:
        return _raise_later(exc)
    return _chain(first, stream)


async def _empty() -> AsyncIterator:
    return
    yield  # pragma: no cover


async def _raise_later(exc: BaseException) -> AsyncIterator:
    raise exc
    yield  # pragma: no cover


async def _chain(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


@contextlib.contextmanager
def engine_errors(step_failures: bool = True) -> Iterator[None]:
    """Engine exceptions -> APIError: rejected 400, step failure 500, dead loop 503."""
    try:
        yield
    except RequestRejectedError as exc:
        raise bad_request(str(exc)) from exc
    except EngineDeadError as exc:
        raise errors.unavailable(str(exc), "engine_dead") from exc
    except QueueFullError as exc:
        raise APIError(429, f"{exc}; retry later", errors.RATE_LIMIT, None, "queue_full") from exc
    except StepFailedError as exc:
        if not step_failures:
            raise
        raise errors.step_failed(str(exc)) from exc


# ----------------------------------------------------------------------------- SSE


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceProgress:
    """How much of one choice's cumulative output was already streamed."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False

    def advance(self, o: CompletionOutput):
        delta = o.text[self.text_len:]
        ids = o.token_ids[self.num_tokens:]
        lps = o.logprobs[self.num_tokens:len(o.token_ids)] if o.logprobs is not None else None
        self.text_len, self.num_tokens = len(o.text), len(o.token_ids)
        self.finished = o.finish_reason is not None
        return delta, ids, lps


def chunk_sse(chunk, include_usage: bool) -> str:
    """A chunk as an SSE event; `usage` (null until the last chunk) only with include_usage."""
    if include_usage:
        return sse(chunk)
    return f"data: {chunk.model_dump_json(exclude={'usage'})}\n\n"


def stream_error_event(exc: BaseException) -> str:
    if isinstance(exc, StepFailedError):
        err = errors.step_failed(str(exc))
    elif isinstance(exc, EngineDeadError):
        err = errors.unavailable(str(exc), "engine_dead")
    elif isinstance(exc, QueueFullError):
        err = APIError(429, f"{exc}; retry later", errors.RATE_LIMIT, None, "queue_full")
    else:
        err = APIError(500, f"{type(exc).__name__}: {exc}", errors.SERVER_ERROR, None, "internal_error")
    return sse(err.body())


class SSEResponse(StreamingResponse):
    """A server-sent-events stream whose body iterator is always closed, so a disconnected
    client's requests are aborted at once instead of whenever the generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
