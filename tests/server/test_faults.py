"""Injected faults on a live server (--enable-fault-injection): a failed step fails only its
requests, a stalled loop fails /health and fills the queue (429), a dead loop fails everything
pending at once and refuses new work (503). The dead-loop test runs last: it ends the server. Each test
runs with the step loop in a thread of the server and in the engine core process.

No wall-clock bounds: the tests wait (bounded by TIMEOUT_S, failing only on a hang) for the state they
check: /health turning 503 while a stalled step still runs, requests in flight before the loop dies. A
stalled step's first step schedules one token, so its limit (stall timeout + 8x one token's predicted
time) comes well before the stall ends on any machine."""

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
ONE = {"model": MODEL, "prompt": [42], "max_tokens": 8, "temperature": 0}  # a one-token prefill
STALL_S = 3.5  # the stalled step: ONE's limit is about STALL_TIMEOUT_S, far below this
TIMEOUT_S = 30


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


async def _until_health(client: httpx.AsyncClient, status: int, still: asyncio.Task = None) -> dict:
    """Poll /health until it answers `status` (and, given `still`, while that request is still in flight); its body.
    Bounded by TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        r = await client.get("/health")
        if r.status_code == status:
            return r.json()
        assert still is None or not still.done(), f"the request ended before /health said {status}: {r.json()}"
        assert time.monotonic() < deadline, f"/health never said {status}: {r.json()}"
        await asyncio.sleep(0.05)


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


def test_stalled_loop_fails_health_then_recovers(server):
    assert _health(server.base_url) == 200
    want = _complete(server.base_url, ONE).json()["choices"][0]["text"]
    _fault(server.base_url, kind="stall", seconds=STALL_S)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=ONE))
            body = await _until_health(client, 503, still=pending)  # while its step is stalled
            response = await pending
            return body, response, await _until_health(client, 200)  # and green again once the step ends

    body, response, after = asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT_S))
    assert "stalled" in body["reason"] and body["pending_requests"] == 1
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == want
    assert after["status"] == "ok"


def test_queue_over_max_len_gets_429(server, expected):
    want_first = _complete(server.base_url, ONE).json()["choices"][0]["text"]
    _fault(server.base_url, kind="stall", seconds=STALL_S)

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=ONE))
            # Requests the loop has not picked up count toward max_queue_len only once they have
            # waited for the stall window, or while /health says stalled (a burst against a healthy
            # loop is admitted): wait until its step has stalled, then the next ones fill the queue.
            await _until_health(client, 503, still=first)
            rest = [asyncio.create_task(client.post("/v1/completions", json=GOOD)) for _ in range(MAX_QUEUE_LEN + 3)]
            return [await first] + [await t for t in rest]

    responses = asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT_S))
    codes = [r.status_code for r in responses]
    assert codes.count(429) >= 3 and set(codes) <= {200, 429}, codes
    assert codes[0] == 200 and responses[0].json()["choices"][0]["text"] == want_first  # the stalled one finished
    for r in responses[1:]:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["text"] == expected
    assert wait_idle(server.base_url)["tallyserve_kv_blocks_in_use"] == 0
    assert _complete(server.base_url).status_code == 200


def test_dead_loop_fails_fast_and_refuses_new_work(server):
    """Killed while three streams generate and a fourth request waits: every one of them ends with the engine's
    death (an engine_dead error, none ran to its 400 tokens), /health turns 503 and new work is refused."""
    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
        events = []
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        return events

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(client, e)) for e in started]
            for e in started:
                await asyncio.wait_for(e.wait(), TIMEOUT_S)
            waiting = asyncio.create_task(client.post("/v1/completions", json=LONG))  # a non-streamed one
            deadline = time.monotonic() + TIMEOUT_S
            while (await client.get("/health")).json()["pending_requests"] < 4:  # all four in flight
                assert time.monotonic() < deadline and not waiting.done(), "the fourth request never arrived"
                await asyncio.sleep(0.02)
            await client.post("/debug/fault", json={"kind": "kill_loop"})
            health = await _until_health(client, 503)
            results = [await s for s in streams]
            pending = await waiting
            new = await client.post("/v1/completions", json=GOOD)
            return health, results, pending, new

    health, results, pending, new = asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT_S))
    assert "not running" in health["reason"]
    for events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        chunks = [json.loads(e) for e in events[:-2]]  # cut by the death, not a normal end of its 400 tokens
        assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))
    assert pending.status_code == 503 and pending.json()["error"]["type"] == "server_error"
    assert new.status_code == 503
    body = httpx.get(server.base_url + "/health", timeout=5).json()
    assert "not running" in body["reason"]
    assert metrics(server.base_url)["tallyserve_engine_alive"] == 0
