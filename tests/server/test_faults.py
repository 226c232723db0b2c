"""Injected faults on a live server (--enable-fault-injection): a failed step fails only its
requests, a stalled loop fails /health and fills the queue (429), a dead loop fails everything
pending at once and refuses new work (503). The dead-loop test runs last: it ends the server. Each test
runs with the step loop in a thread of the server and in the engine core process."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.live_server import MODEL, LiveServer, metrics, wait_idle

STALL_TIMEOUT_S = 1.0
MAX_QUEUE_LEN = 3
GOOD = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 8, "temperature": 0}
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["--disable-frontend-multiprocessing", "--enable-frontend-multiprocessing"],
                ids=["thread", "process"])
def server(tiny_model_dir, server_logs, request):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--enable-fault-injection",
                     "--stall-timeout", str(STALL_TIMEOUT_S), "--max-queue-len", str(MAX_QUEUE_LEN), request.param)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(server) -> str:
    return _complete(server.base_url).json()["choices"][0]["text"]


def _complete(base_url: str, body: dict = GOOD) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json=body, timeout=30)


def _fault(base_url: str, **body) -> None:
    r = httpx.post(base_url + "/debug/fault", json=body, timeout=10)
    assert r.status_code == 200, r.text


def _health(base_url: str) -> int:
    return httpx.get(base_url + "/health", timeout=5).status_code


def _sse_events(response_text: str) -> list[str]:
    return [e[6:] for e in response_text.split("\n\n") if e.startswith("data: ")]


def test_step_exception_fails_only_that_step(server, expected):
    before = metrics(server.base_url)["tallyserve_step_errors_total"]
    _fault(server.base_url, kind="step_exception")
    r = _complete(server.base_url)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "injected" in r.json()["error"]["message"]
    ok = _complete(server.base_url)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected
    m = wait_idle(server.base_url)
    assert m["tallyserve_step_errors_total"] == before + 1
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"]
    assert _health(server.base_url) == 200


def test_step_exception_in_a_stream_is_an_error_event(server, expected):
    _fault(server.base_url, kind="step_exception")
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True})
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_step_failed"
    assert _complete(server.base_url).json()["choices"][0]["text"] == expected
    assert wait_idle(server.base_url)["tallyserve_kv_blocks_in_use"] == 0


def test_stalled_loop_fails_health_then_recovers(server, expected):
    assert _health(server.base_url) == 200
    _fault(server.base_url, kind="stall", seconds=3.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=GOOD))
            t0 = time.monotonic()
            status = 200
            while time.monotonic() - t0 < 2.5 and status == 200:
                await asyncio.sleep(0.1)
                status = (await client.get("/health")).status_code
            unhealthy_after = time.monotonic() - t0
            body = (await client.get("/health")).json()
            response = await pending
            return status, unhealthy_after, body, response

    status, unhealthy_after, body, response = asyncio.run(asyncio.wait_for(run(), 30))
    assert status == 503 and unhealthy_after < 2.5
    assert "stalled" in body["reason"]
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    deadline = time.monotonic() + 5
    while _health(server.base_url) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server.base_url) == 200


def test_queue_over_max_len_gets_429(server, expected):
    _fault(server.base_url, kind="stall", seconds=3.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=GOOD))
            # Requests the loop has not picked up count toward max_queue_len only once they have
            # waited for the stall window, or while /health says stalled (a burst against a healthy
            # loop is admitted): wait until its step has stalled, then the next ones fill the queue.
            deadline = time.monotonic() + 2.5
            while (await client.get("/health")).status_code == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            rest = [asyncio.create_task(client.post("/v1/completions", json=GOOD)) for _ in range(MAX_QUEUE_LEN + 3)]
            return [await first] + [await t for t in rest]

    responses = asyncio.run(asyncio.wait_for(run(), 30))
    codes = [r.status_code for r in responses]
    assert codes.count(429) >= 3 and set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["text"] == expected
    assert wait_idle(server.base_url)["tallyserve_kv_blocks_in_use"] == 0
    assert _complete(server.base_url).status_code == 200


def test_dead_loop_fails_fast_and_refuses_new_work(server):
    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[list[str], float]:
        events = []
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        return events, time.monotonic()

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(client, e)) for e in started]
            for e in started:
                await asyncio.wait_for(e.wait(), 10)
            waiting = asyncio.create_task(client.post("/v1/completions", json=LONG))  # a non-streamed one
            await asyncio.sleep(0.2)
            killed_at = time.monotonic()
            await client.post("/debug/fault", json={"kind": "kill_loop"})
            health = 200
            while health == 200 and time.monotonic() - killed_at < 1.0:
                health = (await client.get("/health")).status_code
            health_after = time.monotonic() - killed_at
            results = [await s for s in streams]
            pending = await waiting
            new = await client.post("/v1/completions", json=GOOD)
            return killed_at, health, health_after, results, pending, new

    killed_at, health, health_after, results, pending, new = asyncio.run(asyncio.wait_for(run(), 30))
    assert health == 503 and health_after < 1.0
    for events, ended_at in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert ended_at - killed_at < 1.0  # failed at once, not after the 400 tokens
    assert pending.status_code == 503 and pending.json()["error"]["type"] == "server_error"
    assert new.status_code == 503
    body = httpx.get(server.base_url + "/health", timeout=5).json()
    assert "not running" in body["reason"]
    assert metrics(server.base_url)["tallyserve_engine_alive"] == 0
