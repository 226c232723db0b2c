"""A table of bad requests (raw httpx): each gets its OpenAI-shaped error with the right status and
type, none disturbs a good request running beside it, and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.live_server import API_KEY as KEY, MODEL, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 12, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD = "invalid_request_error"

# (name, method, path, json body or raw bytes, headers, status, error type)
CASES = [
    ("malformed json", "POST", "/v1/completions", b'{"prompt": "hi", ', AUTH, 400, BAD),
    ("body is a list", "POST", "/v1/completions", [1, 2], AUTH, 400, BAD),
    ("empty body", "POST", "/v1/completions", b"", AUTH, 400, BAD),
    ("missing prompt", "POST", "/v1/completions", {"model": MODEL}, AUTH, 400, BAD),
    ("missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, AUTH, 400, BAD),
    ("negative max_tokens", "POST", "/v1/completions", {**GOOD, "max_tokens": -1}, AUTH, 400, BAD),
    ("zero max_tokens", "POST", "/v1/completions", {**GOOD, "max_tokens": 0}, AUTH, 400, BAD),
    ("huge max_tokens", "POST", "/v1/completions", {**GOOD, "max_tokens": 10**9}, AUTH, 400, BAD),
    ("max_tokens as string", "POST", "/v1/completions", {**GOOD, "max_tokens": "16"}, AUTH, 400, BAD),
    ("max_tokens as float", "POST", "/v1/completions", {**GOOD, "max_tokens": 16.5}, AUTH, 400, BAD),
    ("prompt + max_tokens over max_model_len", "POST", "/v1/completions",
     {**GOOD, "prompt": [5] * 300, "max_tokens": 300}, AUTH, 400, BAD),
    ("prompt over max_model_len", "POST", "/v1/completions", {**GOOD, "prompt": [5] * 600}, AUTH, 400, BAD),
    ("negative temperature", "POST", "/v1/completions", {**GOOD, "temperature": -0.5}, AUTH, 400, BAD),
    ("top_p zero", "POST", "/v1/completions", {**GOOD, "top_p": 0}, AUTH, 400, BAD),
    ("top_p above one", "POST", "/v1/completions", {**GOOD, "top_p": 1.5}, AUTH, 400, BAD),
    ("n zero", "POST", "/v1/completions", {**GOOD, "n": 0}, AUTH, 400, BAD),
    ("n too large", "POST", "/v1/completions", {**GOOD, "n": 100000}, AUTH, 400, BAD),
    ("top_k below -1", "POST", "/v1/completions", {**GOOD, "top_k": -5}, AUTH, 400, BAD),
    ("min_p above one", "POST", "/v1/completions", {**GOOD, "min_p": 2.0}, AUTH, 400, BAD),
    ("seed as string", "POST", "/v1/completions", {**GOOD, "seed": "abc"}, AUTH, 400, BAD),
    ("stream as string", "POST", "/v1/completions", {**GOOD, "stream": "yes"}, AUTH, 400, BAD),
    ("stop of ints", "POST", "/v1/completions", {**GOOD, "stop": [1, 2]}, AUTH, 400, BAD),
    ("empty string prompt", "POST", "/v1/completions", {**GOOD, "prompt": ""}, AUTH, 400, BAD),
    ("empty list prompt", "POST", "/v1/completions", {**GOOD, "prompt": []}, AUTH, 400, BAD),
    ("token id out of range", "POST", "/v1/completions", {**GOOD, "prompt": [1, 999999]}, AUTH, 400, BAD),
    ("negative token id", "POST", "/v1/completions", {**GOOD, "prompt": [[3, -1]]}, AUTH, 400, BAD),
    ("mixed prompt list", "POST", "/v1/completions", {**GOOD, "prompt": ["a", 1]}, AUTH, 400, BAD),
    ("presence_penalty out of range", "POST", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, AUTH, 400, BAD),
    ("frequency_penalty out of range", "POST", "/v1/chat/completions", {**CHAT, "frequency_penalty": -3.0},
     AUTH, 400, BAD),
    ("too many logprobs", "POST", "/v1/completions", {**GOOD, "logprobs": 50}, AUTH, 400, BAD),
    ("echo with logprobs over max_logprobs", "POST", "/v1/completions", {**GOOD, "echo": True, "logprobs": 21},
     AUTH, 400, BAD),
    ("prompt_logprobs with stream", "POST", "/v1/completions", {**GOOD, "prompt_logprobs": 1, "stream": True},
     AUTH, 400, BAD),
    ("empty messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400, BAD),
    ("unknown role", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, AUTH, 400, BAD),
    ("message without content", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user"}]}, AUTH, 400, BAD),
    ("content of wrong type", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 42}]}, AUTH, 400, BAD),
    ("messages not a list", "POST", "/v1/chat/completions", {**CHAT, "messages": "hi"}, AUTH, 400, BAD),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, AUTH, 400, BAD),
    ("top_logprobs too large", "POST", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 25}, AUTH, 400, BAD),
    ("tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, AUTH, 400, BAD),
    ("negative max_completion_tokens", "POST", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": -3}, AUTH, 400, BAD),
    ("unknown model", "POST", "/v1/completions", {**GOOD, "model": "gpt-9"}, AUTH, 404, BAD),
    ("unknown model (chat)", "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, AUTH, 404, BAD),
    ("missing api key", "POST", "/v1/completions", GOOD, {}, 401, "authentication_error"),
    ("wrong api key", "POST", "/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401, "authentication_error"),
    ("wrong auth scheme", "GET", "/v1/models", None, {"Authorization": f"Basic {KEY}"}, 401, "authentication_error"),
    ("no key, malformed body", "POST", "/v1/completions", b"{", {}, 401, "authentication_error"),
    ("unknown route", "GET", "/v1/nothing-here", None, AUTH, 404, "not_found_error"),
    ("wrong method", "GET", "/v1/completions", None, AUTH, 405, BAD),
    ("fault injection disabled", "POST", "/debug/fault", {"kind": "kill_loop"}, AUTH, 404, "not_found_error"),
]


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _send(client: httpx.Client, method, path, body, headers) -> httpx.Response:
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={**headers, "Content-Type": "application/json"})
    return client.request(method, path, json=body, headers=headers)


def _good_text(base_url: str) -> str:
    r = httpx.post(base_url + "/v1/completions", json=GOOD, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_table_has_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name,method,path,body,headers,status,kind", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, method, path, body, headers, status, kind):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        r = _send(client, method, path, body, headers)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == kind and isinstance(err["message"], str) and err["message"]


def test_errors_name_the_parameter(server):
    with httpx.Client(base_url=server.base_url, timeout=30, headers=AUTH) as client:
        for field, value in [("temperature", -1), ("top_p", 2), ("n", 0), ("max_tokens", "x")]:
            r = client.post("/v1/completions", json={**GOOD, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = client.post("/v1/completions", json={**GOOD, "model": "gpt-9"})
        assert r.json()["error"]["code"] == "model_not_found"


def test_open_endpoints_need_no_key(server):
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    assert httpx.get(server.base_url + "/metrics", timeout=5).status_code == 200


def test_bad_requests_do_not_disturb_a_running_request(server):
    expected = _good_text(server.base_url)

    async def run() -> str:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            async def good_stream() -> str:
                text = ""
                body = {**GOOD, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            async def bad(case) -> int:
                _, method, path, body, headers, _, _ = case
                if isinstance(body, bytes):
                    r = await client.request(method, path, content=body,
                                             headers={**headers, "Content-Type": "application/json"})
                else:
                    r = await client.request(method, path, json=body, headers=headers)
                return r.status_code

            results = await asyncio.gather(good_stream(), *(bad(c) for c in CASES))
            assert results[1:] == [c[5] for c in CASES]
            return results[0]

    assert asyncio.run(asyncio.wait_for(run(), 60)) == expected
    assert _good_text(server.base_url) == expected


def test_no_kv_blocks_leak_and_errors_are_counted(server):
    m = wait_idle(server.base_url)
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"] == 256
    assert m["tallyserve_kv_blocks_in_use"] == 0
    assert m["tallyserve_ledger_violations_total"] == 0 and m["tallyserve_step_errors_total"] == 0
    assert m["tallyserve_http_errors_total{status=400}"] >= sum(c[5] == 400 for c in CASES)
    assert metrics(server.base_url)["tallyserve_engine_healthy"] == 1
