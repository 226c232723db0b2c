"""The FastAPI app factory: OpenAI routes, health, metrics, errors in OpenAI's shape (every one,
unexpected exceptions and oversized bodies included), API-key and body-size middleware, an OpenAPI
schema that documents what the routes really return, fault hooks."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tallyserve import __version__
from tallyserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, FaultKind
from tallyserve.server import errors
from tallyserve.server.errors import APIError, validation_message
from tallyserve.server.metrics import CONTENT_TYPE, ServerMetrics, request_scope
from tallyserve.server.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionRequest, CompletionResponse, DetokenizeRequest,
                                        DetokenizeResponse, ErrorResponse, FaultRequest, HealthResponse, ModelCard,
                                        ModelList, TokenizeRequest, TokenizeResponse)
from tallyserve.server.serving import ClientDisconnected, ServerContext, check_model
from tallyserve.server.serving_chat import create_chat_completion
from tallyserve.server.protocol_responses import ResponsesRequest
from tallyserve.server.serving_completion import create_completion
from tallyserve.server.serving_responses import create_response
from tallyserve.server.serving_tokenize import create_detokenize, create_tokenize
from tallyserve.server.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")  # docs, redoc, schema; /docs covers /docs/oauth2-redirect
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # counted in requests_total


def default_max_request_body_bytes(max_model_len: int) -> int:
    """4 MiB plus 64 bytes per token of context: room for a full-length prompt of token ids."""
    return 4 * 1024 * 1024 + 64 * max_model_len


def build_app(engine: AsyncLLMEngine, *, api_key: Optional[str] = None, enable_fault_injection: bool = False,
              shutdown_timeout: float = 5.0, max_request_body_bytes: Optional[int] = None,
              enable_docs: bool = True, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None) -> FastAPI:
    """An app serving `engine`; the engine loop starts with the app and stops when it shuts down.
    The queue limit (429) and stall timeout are the engine's (AsyncLLMEngine arguments). Bodies
    over `max_request_body_bytes` (default: default_max_request_body_bytes) get 413; with an API
    key the docs need it too; `enable_docs=False` removes /docs, /redoc and /openapi.json.
    `tool_call_parser` (a tool_parsers name) reads tool calls for tool_choice "auto", which needs
    `enable_auto_tool_choice` (vLLM's flags)."""
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # ValueError naming the known parsers
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    ctx = ServerContext(engine=engine, metrics=ServerMetrics(engine), served_model_name=engine.served_model_name,
                        api_key=api_key, enable_fault_injection=enable_fault_injection,
                        trust_request_chat_template=trust_request_chat_template,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_parser=tool_call_parser)
    if max_request_body_bytes is None:
        max_request_body_bytes = default_max_request_body_bytes(engine.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        engine.structured.warm_up()  # the grammar compile worker this process validates with
        yield
        engine.draining = True
        ctx.close()
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    docs_url, redoc_url, openapi_url = DOCS_PATHS if enable_docs else (None, None, None)
    app = FastAPI(title="tallyserve", version=__version__, lifespan=lifespan, docs_url=docs_url,
                  redoc_url=redoc_url, openapi_url=openapi_url)
    app.state.ctx = ctx
    _add_error_handlers(app, ctx)
    _add_info_routes(app, ctx)
    _add_openai_routes(app, ctx)
    from tallyserve.server.kv_transfer import add_routes as _add_kv_transfer_routes

    _add_kv_transfer_routes(app, ctx)  # disaggregated serving: NIXL agent metadata for consumers
    if enable_fault_injection:
        _add_fault_routes(app, ctx)
    _document_errors_only_as_returned(app)
    # Added innermost first: InternalErrorMiddleware ends up outermost.
    if api_key is not None:
        protected = APIKeyMiddleware.PROTECTED + (DOCS_PATHS if enable_docs else ())
        app.add_middleware(APIKeyMiddleware, api_key=api_key, ctx=ctx, protected=protected)
    app.add_middleware(BodyLimitMiddleware, limit=max_request_body_bytes, ctx=ctx)
    app.add_middleware(InternalErrorMiddleware, ctx=ctx)
    return app


def _error_response(ctx: ServerContext, err: APIError) -> JSONResponse:
    ctx.metrics.http_errors.labels(status=str(err.status)).inc()
    return err.response()


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return _error_response(ctx, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return _error_response(ctx, errors.bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, ClientDisconnect):
            # FastAPI's 400 "error parsing the body" for a client that left while its body was read:
            # nobody is there for an answer, so it is no error response; a generation route counts it
            # in requests_total as one abort (it reached its route, like a client gone mid-stream)
            if request.url.path in GENERATION_PATHS:
                ctx.metrics.client_left_before_body()
            return Response(status_code=499)
        err = APIError(exc.status_code, str(exc.detail), errors.status_error_type(exc.status_code))
        response = _error_response(ctx, err)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request: Request, _exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it
    # Any other exception: InternalErrorMiddleware.


class InternalErrorMiddleware:
    """Pure ASGI, outermost: every request runs in a metrics request scope (metrics.request_scope:
    an engine request nothing else finished is counted when the exchange ends), and an unexpected
    exception becomes a 500 in OpenAI's shape and is not re-raised. (Starlette's
    ServerErrorMiddleware re-raises after its 500, and uvicorn then drops the connection without
    `Connection: close`, so a pooled client's next request hits a closed socket.) Once a response
    has started nothing can be sent: the exception is logged, and uvicorn closes the connection
    because that response is incomplete."""

    def __init__(self, app, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with request_scope():
            try:
                await self.app(scope, receive, tracking_send)
            except Exception as exc:  # noqa: BLE001 - the point of this middleware
                logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
                if not started:
                    err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", errors.SERVER_ERROR,
                                   None, "internal_error")
                    await _error_response(self.ctx, err)(scope, receive, send)


class BodyLimitMiddleware:
    """Pure ASGI: 413 (`request_too_large`) for a request body over `limit` bytes, before the app
    reads, let alone parses, it: at once from Content-Length; for a chunked body, as soon as the
    bytes received pass the limit (a chunked body is read here first, counted as it arrives, then
    handed on). The 413 closes the connection, after discarding for up to LINGER_S what the client
    still sends, so that it reads the 413 rather than a connection reset."""

    LINGER_S = 1.0

    def __init__(self, app, limit: int, ctx: ServerContext) -> None:
        self.app = app
        self.limit = limit
        self.ctx = ctx

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = _int_or_none(headers.get(b"content-length"))
        if length is not None and length > self.limit:
            await self._reject(receive, send, length)
            return
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            body = await self._read_counted(receive)
            if body is None:
                await self._reject(receive, send, None)
                return
            receive = _replay(body, receive) if body is not _CLIENT_LEFT else receive
        await self.app(scope, receive, send)

    async def _read_counted(self, receive) -> Any:
        """The whole body, None once it passes the limit, or _CLIENT_LEFT when the client leaves
        before its end (the app then reads the disconnect, never a cut body it would call bad JSON)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _CLIENT_LEFT
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _reject(self, receive, send, length: Optional[int]) -> None:
        err = errors.too_large(self.limit, length)
        self.ctx.metrics.http_errors.labels(status=str(err.status)).inc()
        body = err.response().body
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        with contextlib.suppress(asyncio.TimeoutError):  # lingering close: drop what is still coming
            await asyncio.wait_for(_discard_body(receive), self.LINGER_S)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


_CLIENT_LEFT = object()  # _read_counted: the client left before the end of its body


def _int_or_none(value: Optional[bytes]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _replay(body: bytes, receive):
    """A receive that first gives `body` as one message, then defers to `receive` (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


async def _discard_body(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class APIKeyMiddleware:
    """Pure ASGI middleware: /v1, /tokenize, /detokenize and /debug (and the docs, when the app
    passes them in `protected`) need `Authorization: Bearer KEY`, checked before the body is read
    (so a wrong key is a 401 even for a malformed body); /health, /ping, /metrics, /version stay
    open. Not BaseHTTPMiddleware, which would get in the way of streaming and disconnects."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize", "/debug")

    def __init__(self, app, api_key: str, ctx: ServerContext, protected: tuple[str, ...] = PROTECTED) -> None:
        self.app = app
        self.key = api_key.encode()
        self.ctx = ctx
        self.protected = protected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.protected) and not self._authorized(scope):
            err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           errors.AUTHENTICATION, None, "invalid_api_key")
            await _error_response(self.ctx, err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (validation errors included: never 422)",
    401: "Missing or wrong API key",
    404: "Unknown model or route",
    413: "Request body too large",
    429: "Too many requests waiting; retry after `Retry-After` seconds",
    500: "Internal error, or the engine failed while running the request",
    503: "The engine is not running, or the server is shutting down",
}


def _errors(*statuses: int) -> dict[int, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, all in OpenAI's error shape."""
    out: dict[int, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        if status == 429:
            out[status]["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    return out


def _streamed(chunk_model: type) -> dict[int, dict[str, Any]]:
    """OpenAPI: the 200 is JSON, or server-sent events of `chunk_model` with `stream: true`."""
    return {200: {"description": f"JSON; with `stream: true`, server-sent events of {chunk_model.__name__} "
                                 "ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _document_errors_only_as_returned(app: FastAPI) -> None:
    """Drop the 422 FastAPI documents for every route with a body: validation errors are 400."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def _add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    unhealthy = {503: {"model": HealthResponse, "description": "Engine loop dead or stalled"}}

    def health_response() -> JSONResponse:
        h = ctx.engine.health()
        body = {"status": "ok" if h.healthy else "unhealthy", "reason": h.reason, "pending_requests": h.pending,
                "seconds_since_last_step": round(h.seconds_since_heartbeat, 3)}
        return JSONResponse(body, status_code=200 if h.healthy else 503)

    @app.get("/health", response_model=HealthResponse, responses=unhealthy)
    async def health():
        return health_response()

    @app.head("/health", response_class=Response,
              responses={200: {"description": "Healthy (status only, no body)"},
                         503: {"description": "Engine loop dead or stalled (status only, no body)"}})
    async def health_head():
        return Response(status_code=health_response().status_code)

    # vLLM's /ping (SageMaker's health check, GET and POST) answers exactly what /health does.
    @app.api_route("/ping", methods=["GET", "POST"], response_model=HealthResponse, responses=unhealthy)
    async def ping():
        return health_response()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def _add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    def model_card() -> ModelCard:
        return ModelCard(id=ctx.served_model_name, root=ctx.served_model_name, max_model_len=ctx.engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401, 500))
    async def models():
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(401, 404, 500))
    async def model(model_id: str):
        check_model(ctx, model_id)  # 404 for any other id (ids with slashes arrive whole)
        return JSONResponse(model_card().model_dump())

    post_errors = _errors(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_streamed(CompletionResponse), **post_errors})
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_streamed(ChatCompletionChunk), **post_errors})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @app.post("/v1/responses", responses={**_streamed(ResponsesRequest), **post_errors})
    async def responses(body: ResponsesRequest, raw: Request):
        return await create_response(ctx, body, raw)

    tokenizer_errors = _errors(400, 401, 404, 413, 500)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_errors)
    async def tokenize(body: TokenizeRequest):
        return await create_tokenize(ctx, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_errors)
    async def detokenize(body: DetokenizeRequest):
        return await create_detokenize(ctx, body)


def _add_fault_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/debug/fault", responses=_errors(400, 401, 413, 500, 503))
    async def fault(body: FaultRequest):
        if body.kind == "handler_exception":  # not the engine's: this handler fails unexpectedly
            raise RuntimeError("injected handler exception")
        try:
            ctx.engine.inject_fault(FaultKind(body.kind), body.seconds or 0.0)
        except EngineDeadError as exc:
            raise errors.unavailable(str(exc), "engine_dead") from exc
        logger.warning("fault injected over HTTP: %s", body.kind)
        return {"status": "injected", "kind": body.kind}
