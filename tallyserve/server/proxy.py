"""`tallyserve proxy`: an OpenAI-compatible front for disaggregated prefill/decode.

For each completions or chat request it asks a prefill instance (a kv_producer) for the prompt's KV:
the same body with ``max_tokens=1``, ``n=1``, no streaming and ``kv_transfer_params:
{"do_remote_decode": true}``; the answer carries the ``kv_transfer_params`` a decode instance (a
kv_consumer) needs to pull that KV. The original request then goes to a decode instance with those
params, and its answer (streamed or not) goes back to the client unchanged.

Routing: the least loaded healthy instance of each role (requests in flight); a prompt's first
characters pick a preferred prefill instance (rendezvous hashing), so requests sharing a prefix
reuse its prefix cache, unless that instance is much busier than the least loaded one. A prefill
instance that fails or is unreachable: the decode instance computes the prompt itself. ``/health``
is 503 while a role has no healthy instance; ``/metrics`` counts requests, prefill latency and the
instances' own KV transfer counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 4  # a preferred prefill instance is used unless it has this many more in flight
HEALTH_INTERVAL_S = 1.0
PREFIX_CHARS = 256


@dataclass
class Instance:
    url: str
    role: str
    in_flight: int = 0
    healthy: bool = True
    requests: int = 0
    failures: int = 0


@dataclass
class ProxyStats:
    requests: int = 0
    prefill_failures: int = 0  # prefill answered an error or was unreachable: decode computed it all
    prefill_seconds: float = 0.0
    prefill_count: int = 0
    decode_errors: int = 0
    by_route: dict = field(default_factory=dict)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "service_unavailable" if status == 503 else
                                   "invalid_request_error", "param": None, "code": code}}, status_code=status)


def _prefix_key(body: dict) -> str:
    if "messages" in body:
        text = json.dumps(body.get("messages"), sort_keys=True)
    else:
        text = json.dumps(body.get("prompt"))
    return text[:PREFIX_CHARS]


class Router:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode instance")
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.stats = ProxyStats()

    def pick(self, role: str, key: Optional[str] = None) -> Optional[Instance]:
        pool = [i for i in (self.prefill if role == "prefill" else self.decode) if i.healthy]
        if not pool:
            return None
        least = min(pool, key=lambda i: i.in_flight)
        if key is None:
            return least
        preferred = max(pool, key=lambda i: hashlib.blake2b(f"{i.url}|{key}".encode(), digest_size=8).digest())
        return preferred if preferred.in_flight <= least.in_flight + AFFINITY_SLACK else least

    def healthy(self) -> bool:
        return any(i.healthy for i in self.prefill) and any(i.healthy for i in self.decode)


def _prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of", "min_tokens",
                                                      "echo", "logprobs", "top_logprobs")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def build_proxy_app(prefill: list[str], decode: list[str], timeout: float = 600.0) -> FastAPI:
    router = Router(prefill, decode)
    state: dict[str, Any] = {}

    async def check_health() -> None:
        client = state["client"]
        while True:
            for inst in router.prefill + router.decode:
                try:
                    r = await client.get(inst.url + "/health", timeout=2.0)
                    inst.healthy = r.status_code == 200
                except httpx.HTTPError:
                    inst.healthy = False
            await asyncio.sleep(HEALTH_INTERVAL_S)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),
                                            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        task = asyncio.create_task(check_health())
        yield
        task.cancel()
        await state["client"].aclose()

    app = FastAPI(title="tallyserve proxy", lifespan=lifespan)
    app.state.router = router

    async def _prefill(body: dict, path: str, headers: dict) -> Optional[dict]:
        """The kv_transfer_params of a prefill run, or None (the decode instance then computes it all)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
            return None  # several prompts in one request: the decode instance computes them
        inst = router.pick("prefill", _prefix_key(body))
        if inst is None:
            return None
        inst.in_flight += 1
        t0 = time.monotonic()
        try:
            r = await state["client"].post(inst.url + path, json=_prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            inst.healthy, inst.failures = False, inst.failures + 1
            router.stats.prefill_failures += 1
            logger.warning("prefill instance %s failed: %s", inst.url, exc)
            return None
        finally:
            inst.in_flight -= 1
        inst.requests += 1
        router.stats.prefill_seconds += time.monotonic() - t0
        router.stats.prefill_count += 1
        if r.status_code != 200:
            router.stats.prefill_failures += 1
            if 400 <= r.status_code < 500:
                raise _ClientError(r)
            return None
        return r.json().get("kv_transfer_params")

    async def _forward(raw: Request, path: str) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json")
        router.stats.requests += 1
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            params = await _prefill(body, path, headers)
        except _ClientError as exc:  # the request itself is bad: the prefill instance said why
            return Response(exc.reply.content, status_code=exc.reply.status_code, media_type="application/json")
        inst = router.pick("decode")
        if inst is None:
            return _error(503, "no healthy decode instance", "no_decode_instance")
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        client = state["client"]
        inst.in_flight += 1
        try:
            if body.get("stream"):
                req = client.build_request("POST", inst.url + path, json=body, headers=headers)
                r = await client.send(req, stream=True)
                return StreamingResponse(_relay(r, inst), status_code=r.status_code,
                                         media_type=r.headers.get("content-type", "text/event-stream"))
            r = await client.post(inst.url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            inst.healthy = False
            router.stats.decode_errors += 1
            inst.in_flight -= 1
            return _error(503, f"decode instance {inst.url} failed: {type(exc).__name__}", "decode_failed")
        inst.in_flight -= 1
        inst.requests += 1
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def _relay(r: httpx.Response, inst: Instance):
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        finally:
            await r.aclose()
            inst.in_flight -= 1
            inst.requests += 1

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await _forward(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        inst = router.pick("decode")
        if inst is None:
            return _error(503, "no healthy decode instance", "no_decode_instance")
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        r = await state["client"].get(inst.url + "/v1/models", headers=headers)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {role: [{"url": i.url, "healthy": i.healthy, "in_flight": i.in_flight} for i in pool]
                for role, pool in (("prefill", router.prefill), ("decode", router.decode))}
        return JSONResponse(body, status_code=200 if router.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await _metrics_text(router, state["client"]), media_type="text/plain; version=0.0.4")

    return app


class _ClientError(Exception):
    def __init__(self, reply: httpx.Response) -> None:
        super().__init__(reply.status_code)
        self.reply = reply


async def _metrics_text(router: Router, client: httpx.AsyncClient) -> str:
    st = router.stats
    lines = [
        "# TYPE tallyserve_proxy_requests_total counter", f"tallyserve_proxy_requests_total {st.requests}",
        "# TYPE tallyserve_proxy_prefill_failures_total counter",
        f"tallyserve_proxy_prefill_failures_total {st.prefill_failures}",
        "# TYPE tallyserve_proxy_decode_errors_total counter", f"tallyserve_proxy_decode_errors_total {st.decode_errors}",
        "# TYPE tallyserve_proxy_prefill_seconds summary",
        f"tallyserve_proxy_prefill_seconds_sum {st.prefill_seconds}",
        f"tallyserve_proxy_prefill_seconds_count {st.prefill_count}",
        "# TYPE tallyserve_proxy_instance_healthy gauge",
    ]
    for inst in router.prefill + router.decode:
        lines.append(f'tallyserve_proxy_instance_healthy{{role="{inst.role}",url="{inst.url}"}} {int(inst.healthy)}')
    for inst in router.prefill + router.decode:  # the instances' KV transfer counters, labelled
        try:
            text = (await client.get(inst.url + "/metrics", timeout=2.0)).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("tallyserve_kv_connector_"):
                name, _, value = line.partition(" ")
                lines.append(f'{name}{{role="{inst.role}",url="{inst.url}"}} {value}')
    return "\n".join(lines) + "\n"


def register(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="OpenAI-compatible front for disaggregated prefill/decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="append", required=True, help="URL of a kv_producer instance (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="URL of a kv_consumer instance (repeatable)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an upstream request may take")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)


def _serve(ns) -> int:
    import uvicorn

    app = build_proxy_app(ns.prefill, ns.decode, ns.timeout)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=False)
    return 0
