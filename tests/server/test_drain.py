"""SIGTERM drains: the server stops accepting work, lets in-flight streams finish, and exits 0;
a request stuck past --drain-timeout does not keep it from exiting 0. Waits are bounded (WAIT_S) and
fail only on a hang; no wall-clock bounds."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.server.live_server import MODEL, LiveServer

STREAM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}
WAIT_S = 30


async def _stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[dict]:
    events = []
    async with client.stream("POST", "/v1/completions", json=STREAM) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                events.append({"done": True})
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                started.set()
    return events


async def _new_request_refused(base_url: str) -> bool:
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=5) as fresh:
            r = await fresh.post("/v1/completions", json={**STREAM, "stream": False, "max_tokens": 4})
            return r.status_code == 503
    except httpx.TransportError:
        return True  # the listener is closed


def test_sigterm_finishes_in_flight_streams_and_exits_0(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--drain-timeout", "30")
    try:
        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(_stream(client, e)) for e in started]
                for e in started:
                    await asyncio.wait_for(e.wait(), 15)
                srv.terminate()
                deadline = time.monotonic() + WAIT_S  # until the server has noticed the signal (bounded)
                while not (refused := await _new_request_refused(srv.base_url)) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return refused, [await s for s in streams]

        refused, results = asyncio.run(asyncio.wait_for(run(), 60))
        assert refused
        for events in results:
            assert events[-1] == {"done": True}
            assert events[-2]["usage"]["completion_tokens"] == 64
            assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"
        assert srv.wait(30) == 0, srv.log_tail()
    finally:
        srv.stop()


def test_drain_timeout_bounds_shutdown(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--drain-timeout", "0.5",
                     "--enable-fault-injection")
    try:
        # a stall that outlasts the test by far: exiting at all shows the drain timeout bounded the shutdown
        httpx.post(srv.base_url + "/debug/fault", json={"kind": "stall", "seconds": 600}, timeout=5)

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=2 * WAIT_S) as client:
                stuck = asyncio.create_task(client.post("/v1/completions", json={**STREAM, "stream": False}))
                deadline = time.monotonic() + WAIT_S
                while (await client.get("/health")).json()["pending_requests"] < 1:  # in flight, stuck in its step
                    assert time.monotonic() < deadline and not stuck.done(), "the request never arrived"
                    await asyncio.sleep(0.05)
                srv.terminate()
                rc = await asyncio.to_thread(srv.wait, WAIT_S)
                return rc, await stuck

        rc, stuck = asyncio.run(asyncio.wait_for(run(), 3 * WAIT_S))
        assert rc == 0, srv.log_tail()
        assert stuck.status_code == 503 and stuck.json()["error"]["type"] == "server_error"  # told, not dropped
    finally:
        srv.stop()
