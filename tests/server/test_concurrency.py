"""64 concurrent streaming clients, a third of them hanging up at random points: every finished
stream equals the non-streamed greedy output of its prompt, and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.server.live_server import API_KEY, MODEL, metrics, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 24
TIMEOUT_S = 120.0
SHARED = "The scheduler decides which requests run in each step, and the tally is exact. "


def _prompts() -> list[str]:
    rng = random.Random(0)
    words = "fox dog cat engine block token step queue prefix cache budget request".split()
    prompts = []
    for i in range(NUM_CLIENTS):
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        prompts.append((SHARED if i % 2 else "") + f"{i}: {tail}")
    return prompts


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


async def _reference(client: httpx.AsyncClient, prompt: str) -> dict:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def _stream(client: httpx.AsyncClient, prompt: str, hang_up_after) -> tuple[str, str, bool]:
    """(text, finish_reason, done); hang_up_after = number of chunks to read before closing, or None."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, reason, chunks = "", None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, reason, True
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return text, reason, False  # leaving the block closes the connection mid-stream
    return text, reason, False


def test_64_concurrent_streams_with_disconnects(server):
    prompts = _prompts()
    rng = random.Random(1)
    hang_ups = [rng.randint(1, 6) if i % 3 == 0 else None for i in range(NUM_CLIENTS)]
    before = wait_idle(server.base_url)

    async def run():
        limits = httpx.Limits(max_connections=2 * NUM_CLIENTS, max_keepalive_connections=2 * NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            refs = await asyncio.gather(*(_reference(client, p) for p in prompts))
            streams = await asyncio.gather(*(_stream(client, p, h) for p, h in zip(prompts, hang_ups)))
        return refs, streams

    refs, streams = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finished = 0
    for prompt, ref, hang_up, (text, reason, done) in zip(prompts, refs, hang_ups, streams):
        if hang_up is None:
            assert done, prompt
        if done:
            finished += 1
            assert text == ref["text"], prompt
            assert reason == ref["finish_reason"], prompt
        else:
            assert ref["text"].startswith(text), prompt  # a hung-up stream was correct so far
    assert finished >= NUM_CLIENTS * 2 // 3

    after = wait_idle(server.base_url)
    assert after["tallyserve_kv_blocks_free"] == after["tallyserve_kv_blocks_total"] == 256
    assert after["tallyserve_num_requests_running"] == 0 and after["tallyserve_num_requests_waiting"] == 0
    aborted = after["tallyserve_requests_total{finish_reason=abort}"] - before["tallyserve_requests_total{finish_reason=abort}"]
    assert aborted >= 1  # hang-ups really aborted requests in the engine
    completed = sum(after[f"tallyserve_requests_total{{finish_reason={r}}}"] - before[f"tallyserve_requests_total{{finish_reason={r}}}"]
                    for r in ("stop", "length", "abort", "error"))
    assert completed == 2 * NUM_CLIENTS  # every request (references and streams) was accounted for once
    assert after["tallyserve_ledger_violations_total"] == 0 and after["tallyserve_step_errors_total"] == 0
    assert metrics(server.base_url)["tallyserve_engine_healthy"] == 1


def test_non_streaming_clients_that_give_up_abort_their_requests(server):
    """A client that stops waiting for a non-streamed answer (timeout, cancel) frees its blocks
    at once: its request ends as an abort, not after its 400 tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    before = wait_idle(server.base_url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def running(client) -> float:
        text = (await client.get("/metrics")).text
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "tallyserve_num_requests_running")

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(8)]
            # give up once all eight are generating (a fixed wait was either too short for a loaded machine
            # or long enough for the tiny model to finish some of them)
            while await running(client) < 8 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 30))
    after = wait_idle(server.base_url)
    assert after["tallyserve_kv_blocks_free"] == after["tallyserve_kv_blocks_total"]
    key = "tallyserve_requests_total{finish_reason=abort}"
    assert after[key] - before[key] == 8
    assert after["tallyserve_generation_tokens_total"] - before["tallyserve_generation_tokens_total"] < 8 * 400
