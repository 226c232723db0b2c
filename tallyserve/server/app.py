"""The FastAPI app factory: OpenAI routes, health, metrics, errors in OpenAI's shape, fault hooks."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tallyserve import __version__
from tallyserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, FaultKind
from tallyserve.server import errors
from tallyserve.server.errors import APIError, validation_message
from tallyserve.server.metrics import CONTENT_TYPE, ServerMetrics
from tallyserve.server.protocol import ChatCompletionRequest, CompletionRequest, FaultRequest, ModelCard, ModelList
from tallyserve.server.serving import ClientDisconnected, ServerContext
from tallyserve.server.serving_chat import create_chat_completion
from tallyserve.server.serving_completion import create_completion

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLMEngine, *, api_key: Optional[str] = None, enable_fault_injection: bool = False,
              shutdown_timeout: float = 5.0) -> FastAPI:
    """An app serving `engine`; the engine loop starts with the app and stops when it shuts down.
    The queue limit (429) and stall timeout are the engine's (AsyncLLMEngine arguments)."""
    ctx = ServerContext(engine=engine, metrics=ServerMetrics(engine), served_model_name=engine.served_model_name,
                        api_key=api_key, enable_fault_injection=enable_fault_injection)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        engine.draining = True
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    app = FastAPI(title="tallyserve", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app, ctx)
    _add_info_routes(app, ctx)
    _add_openai_routes(app, ctx)
    if enable_fault_injection:
        _add_fault_routes(app, ctx)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, ctx=ctx)
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
    async def http_error(_request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), errors.status_error_type(exc.status_code))
        response = _error_response(ctx, err)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request: Request, _exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception):
        logger.exception("unhandled error")
        return _error_response(ctx, APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                             errors.SERVER_ERROR, None, "internal_error"))


class APIKeyMiddleware:
    """Pure ASGI middleware: /v1 and /debug need `Authorization: Bearer KEY`, checked before the
    body is read (so a wrong key is a 401 even for a malformed body); /health, /metrics, /version
    stay open. Not BaseHTTPMiddleware, which would get in the way of streaming and disconnects."""

    PROTECTED = ("/v1", "/debug")

    def __init__(self, app, api_key: str, ctx: ServerContext) -> None:
        self.app = app
        self.key = api_key.encode()
        self.ctx = ctx

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED) and not self._authorized(scope):
            err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           errors.AUTHENTICATION, None, "invalid_api_key")
            await _error_response(self.ctx, err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health():
        h = ctx.engine.health()
        body = {"status": "ok" if h.healthy else "unhealthy", "reason": h.reason, "pending_requests": h.pending,
                "seconds_since_last_step": round(h.seconds_since_heartbeat, 3)}
        return JSONResponse(body, status_code=200 if h.healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def _add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=ctx.served_model_name, root=ctx.served_model_name, max_model_len=ctx.engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)


def _add_fault_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/debug/fault")
    async def fault(body: FaultRequest):
        try:
            ctx.engine.inject_fault(FaultKind(body.kind), body.seconds or 0.0)
        except EngineDeadError as exc:
            raise errors.unavailable(str(exc), "engine_dead") from exc
        logger.warning("fault injected over HTTP: %s", body.kind)
        return {"status": "injected", "kind": body.kind}
