"""SIGTERM drains: the server stops accepting work, lets in-flight streams finish, and exits 0;
a request stuck past --drain-timeout does not keep it from exiting 0."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.server.live_server import MODEL, LiveServer

STREAM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}


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
                await asyncio.sleep(0.5)
                refused = await _new_request_refused(srv.base_url)
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
        httpx.post(srv.base_url + "/debug/fault", json={"kind": "stall", "seconds": 60}, timeout=5)

        async def run():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
                stuck = asyncio.create_task(client.post("/v1/completions", json={**STREAM, "stream": False}))
                await asyncio.sleep(0.5)
                t0 = time.monotonic()
                srv.terminate()
                rc = await asyncio.to_thread(srv.wait, 30)
                return rc, time.monotonic() - t0, await stuck

        rc, took, stuck = asyncio.run(asyncio.wait_for(run(), 60))
        assert rc == 0, srv.log_tail()
        assert took < 10
        assert stuck.status_code == 503 and stuck.json()["error"]["type"] == "server_error"  # told, not dropped
    finally:
        srv.stop()
