"""The request counters agree with what clients saw: every completions / chat request that reaches
its route is in tallyserve_requests_total exactly once, however it ends (read to the end, client
gone after the first chunk, before the first chunk, before the response started, while its body
was being read), and tallyserve_http_errors_total counts no error a client was never given (a
client that left while its body was read is one abort, not a 400).

A live round of streaming clients (the official openai client, httpx and raw sockets) against the
shared server, and, in process, the windows a live round cannot aim at: the ASGI app driven with
a `receive` that reports the disconnect exactly where the test wants it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, HOST, MODEL, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200,
        "temperature": 0, "ignore_eos": True, "stream": True}
PER_KIND = 6
TIMEOUT_S = 60
REASONS = ("stop", "length", "abort", "error")


def _requests_total(m: dict) -> float:
    return sum(m.get(f"tallyserve_requests_total{{finish_reason={r}}}", 0.0) for r in REASONS)


def _errors(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("tallyserve_http_errors_total")}


# ----------------------------------------------------------------------------- the clients of a round


async def _read_to_the_end(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(**{k: v for k, v in BODY.items() if k != "ignore_eos"},
                                               extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"


async def _leave_after_the_first_chunk(http: httpx.AsyncClient) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=BODY) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # leaving the block closes the connection: the rest is unread


async def _leave_before_the_first_chunk(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(**{k: v for k, v in BODY.items() if k != "ignore_eos"},
                                               extra_body={"ignore_eos": True})
    await stream.close()  # the response started (200 and headers); no chunk read


def _raw_request(port: int) -> bytes:
    payload = json.dumps(BODY).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    return head + payload


async def _leave_right_after_sending(port: int, cut: int = 0) -> None:
    """Send the request (without its last `cut` bytes) and close at once: the server meets the
    disconnect while it reads the body, or soon after."""
    reader, writer = await asyncio.open_connection(HOST, port)
    data = _raw_request(port)
    writer.write(data[:len(data) - cut])
    await writer.drain()
    writer.close()  # FIN after the data: the server reads what was sent, then sees the client gone
    await writer.wait_closed()


def test_a_round_of_streaming_clients_that_leave_early_is_counted_once_each(api_server):
    before = wait_idle(api_server.base_url)
    port = int(api_server.base_url.rsplit(":", 1)[1])

    async def run() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=api_server.base_url, headers=AUTH, timeout=TIMEOUT_S,
                                     limits=limits) as http, \
                openai.AsyncOpenAI(base_url=api_server.base_url + "/v1", api_key=API_KEY, timeout=TIMEOUT_S,
                                   max_retries=0) as oai:
            clients = []
            for _ in range(PER_KIND):
                clients += [_read_to_the_end(oai), _leave_after_the_first_chunk(http), _leave_before_the_first_chunk(oai),
                            _leave_right_after_sending(port), _leave_right_after_sending(port, cut=20)]
            await asyncio.gather(*clients)

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    n = 5 * PER_KIND
    # the server counts a request when it sees its client gone: wait (bounded) until it has seen them all
    deadline = time.monotonic() + TIMEOUT_S
    while _requests_total(metrics(api_server.base_url)) - _requests_total(before) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    after = wait_idle(api_server.base_url)
    assert _requests_total(after) - _requests_total(before) == n  # each one once: none lost, none twice
    assert after["tallyserve_requests_total{finish_reason=length}"] - \
        before["tallyserve_requests_total{finish_reason=length}"] >= PER_KIND  # the readers finished
    assert _errors(after) == _errors(before)  # no error response that no client received
    assert after["tallyserve_kv_blocks_free"] == after["tallyserve_kv_blocks_total"]


# ----------------------------------------------------------------------------- in process, each window


@pytest.fixture(scope="module")
def app_and_engine(tiny_model_dir):
    from tallyserve.config import EngineArgs
    from tallyserve.engine.async_engine import AsyncLLMEngine
    from tallyserve.engine.llm_engine import LLMEngine
    from tallyserve.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=tiny_model_dir, num_gpu_blocks_override=64, block_size=8)))
    engine.start()  # the app's lifespan does not run when the test calls it directly
    yield build_app(engine), engine
    engine.shutdown(10)


def _sample(app, name: str, **labels) -> float:
    return app.state.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


def _counts(app) -> dict:
    out = {r: _sample(app, "tallyserve_requests_total", finish_reason=r) for r in REASONS}
    out["errors"] = sum(s.value for f in app.state.ctx.metrics.http_errors.collect() for s in f.samples
                        if s.name.endswith("_total"))
    return out


class _Sent(list):
    """The messages the app sent, and an event set at each one."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    async def until(self, condition) -> None:
        while not condition(self):
            self.changed.clear()
            await self.changed.wait()


async def _call(app, receive, body: dict) -> list[dict]:
    """POST /v1/chat/completions through the ASGI app with this `receive`; the messages sent."""
    sent = _Sent()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(json.dumps(body).encode())).encode())]}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)  # a send may suspend (flow control, the slow-client guard): cancellable there
        sent.append(message)
        sent.changed.set()

    await app(scope, receive(sent), send)
    return sent


def _receiver(body: dict, gone_on_call: int, wait_for=None):
    """A `receive` giving the body first; from call `gone_on_call` on, the disconnect (after
    `wait_for(sent)` is true); calls in between (the server watching for a disconnect) wait forever."""
    def make(sent: _Sent):
        calls = 0

        async def receive() -> dict:
            nonlocal calls
            calls += 1
            if calls < gone_on_call:
                if calls == 1:
                    return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
                await asyncio.Event().wait()  # nothing happens on this connection (cancelled by the server)
            if wait_for is not None:
                await sent.until(wait_for)
            return {"type": "http.disconnect"}
        return receive
    return make


def _engine_idle(engine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return True
        time.sleep(0.02)
    return False


def _first_chunk_sent(sent: list[dict]) -> bool:
    return any(m["type"] == "http.response.body" and m.get("body") for m in sent)


@pytest.mark.parametrize("window,gone_on_call,wait_for,status", [
    ("while its body is read", 1, None, 499),  # FastAPI would call it a 400 "error parsing the body"
    # missed by the priming watcher, seen as the response starts: cancelled in its first send, the body never runs
    ("before the response started", 3, None, None),
    ("after the first chunk", 3, _first_chunk_sent, 200),
])
def test_each_window_of_a_client_leaving_counts_one_abort_and_no_error(app_and_engine, window, gone_on_call,
                                                                       wait_for, status):
    app, engine = app_and_engine
    body = {**BODY, "model": None, "max_tokens": 400}  # still running when its client leaves: the engine aborts it

    async def run():
        before = _counts(app)
        sent = await _call(app, _receiver(body, gone_on_call, wait_for), body)
        return before, _counts(app), sent  # counted by the time the exchange ends, not by a later collection

    before, after, sent = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    if status is not None:
        assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == status, (window, sent[:1])
    assert after["abort"] - before["abort"] == 1, window
    assert {k: v for k, v in after.items() if k != "abort"} == {k: v for k, v in before.items() if k != "abort"}, window
    assert _engine_idle(engine), window  # its engine request was aborted, its blocks freed


def test_a_stream_read_to_the_end_counts_once_by_its_finish_reason(app_and_engine):
    app, engine = app_and_engine
    body = {**BODY, "model": None, "max_tokens": 8}

    def ended(sent: list[dict]) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body", False) for m in sent)

    async def run():
        before = _counts(app)
        sent = await _call(app, _receiver(body, 3, ended), body)
        return before, _counts(app), sent

    before, after, sent = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert b"data: [DONE]" in b"".join(m.get("body", b"") for m in sent)
    assert after["length"] - before["length"] == 1
    assert {k: v for k, v in after.items() if k != "length"} == {k: v for k, v in before.items() if k != "length"}
    assert _engine_idle(engine)
