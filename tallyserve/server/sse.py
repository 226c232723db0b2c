"""Server-sent events: framing, per-choice progress of cumulative outputs, in-band error events, and
the SSE response whose sends are guarded against clients that stop reading (--slow-client-timeout)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from fastapi.responses import StreamingResponse

from tallyserve.engine.async_engine import EngineDeadError, QueueFullError, StepFailedError
from tallyserve.outputs import CompletionOutput
from tallyserve.server import errors
from tallyserve.server.errors import APIError
from tallyserve.server.serving import ServerContext

if TYPE_CHECKING:
    from tallyserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


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
        err = errors.rate_limited(f"{exc}; retry later")  # in-band: the Retry-After header is already past
    else:
        err = APIError(500, f"{type(exc).__name__}: {exc}", errors.SERVER_ERROR, None, "internal_error")
    return sse(err.body())


class SSEResponse(StreamingResponse):
    """A server-sent-events stream whose body iterator is always closed, so a disconnected
    client's requests are aborted at once instead of whenever the generator is collected.
    `source` (the engine stream the body reads, serving.prime's result) is closed too: a client
    that leaves before the body starts (Starlette then never runs the body generator, so its own
    cleanup never runs) still has its requests aborted and counted at once.

    A client that stops reading is cut off: when one `send` stays blocked (uvicorn's flow control
    holds it while the client does not read) longer than the engine's `slow_client_timeout`, the
    body iterator is closed (its requests are aborted and their KV blocks freed), the connection is
    closed and `tallyserve_slow_client_aborts_total` counts it."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], source: Optional[AsyncIterator[Any]] = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        ctx = _server_context(scope)
        timeout = getattr(ctx.engine, "slow_client_timeout", None) if ctx is not None else None
        if timeout:
            send = _SlowClientGuard(self, send, timeout, ctx.metrics).send
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if self.source is not None:
                await self.source.aclose()


class SlowClientError(Exception):
    """A streaming client did not read for the slow client timeout (its connection could not be
    closed directly, so the response fails and the server closes it)."""


_FRAMING_BYTES = 64  # chunked-encoding framing (or response headers) a send adds to its body


class _SlowClientGuard:
    """Wraps an SSE response's `send` with the slow client timeout; see SSEResponse."""

    def __init__(self, response: SSEResponse, send: Any, timeout: float, metrics: ServerMetrics) -> None:
        self.response, self.inner, self.timeout, self.metrics = response, send, timeout, metrics
        self.cut_off = False
        # A send blocks only when writing is paused, or when this write takes the transport's
        # buffer past its high-water mark (the server then waits for it to drain). Short of both,
        # the send needs no timer (a task and a timer per chunk add up at hundreds of streams).
        owner = _find_owner(send, "transport")
        flow = getattr(owner, "flow", None) if owner is not None else None
        self.flow, self.transport = (flow, owner.transport) if hasattr(flow, "write_paused") else (None, None)
        self.high_water = self.transport.get_write_buffer_limits()[1] if self.transport is not None else 0

    def _cannot_block(self, message: dict) -> bool:
        if self.flow is None or self.flow.write_paused:
            return False
        size = len(message.get("body", b"")) + _FRAMING_BYTES
        return self.transport.get_write_buffer_size() + size <= self.high_water

    async def send(self, message: dict) -> None:
        if self.cut_off:
            return  # the connection is gone: the rest of the response goes nowhere
        if self._cannot_block(message):
            await self.inner(message)
            return
        try:
            await asyncio.wait_for(self.inner(message), self.timeout)
        except asyncio.TimeoutError:
            await self._cut_off()

    async def _cut_off(self) -> None:
        self.cut_off = True
        logger.warning("a streaming client did not read for %ss: aborting its request(s)", self.timeout)
        self.metrics.slow_client_aborts.inc()
        await self.response.body_iterator.aclose()  # aborts the engine requests: KV blocks return now
        transport = _find_transport(self.inner)
        if transport is None:
            raise SlowClientError(f"the client did not read for {self.timeout}s")
        transport.abort()  # close() would wait for the unread bytes to flush, i.e. forever


def _server_context(scope) -> Optional[ServerContext]:
    """The ServerContext of the app serving `scope` (build_app keeps it in app.state.ctx)."""
    app = scope.get("app")
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    return ctx if isinstance(ctx, ServerContext) else None


def _find_transport(send: Any) -> Optional[asyncio.BaseTransport]:
    """The connection's transport behind an ASGI `send`: uvicorn's `send` is a method of its
    request-response cycle, which holds the transport (and the flow control); middlewares wrap it
    in closures. ASGI gives no other way to drop a connection whose client does not read."""
    owner = _find_owner(send, "transport")
    return owner.transport if owner is not None else None


def _find_owner(send: Any, attr: str, max_depth: int = 12) -> Any:
    """The object behind an ASGI `send` (through middleware closures) whose `transport` is an
    asyncio transport. None if not found."""
    todo, seen = [(send, 0)], set()
    while todo:
        fn, depth = todo.pop()
        if id(fn) in seen or depth > max_depth:
            continue
        seen.add(id(fn))
        owner = getattr(fn, "__self__", None)
        if isinstance(getattr(owner, attr, None), asyncio.BaseTransport):
            return owner
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if inspect.isfunction(value) or inspect.ismethod(value):
                todo.append((value, depth + 1))
    return None
