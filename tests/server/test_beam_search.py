"""Beam search over HTTP (vLLM's use_beam_search / best_of / length_penalty): the choices equal the
offline `LLM.beam_search` on the same weights, the bad combinations are OpenAI-shaped 400s, a client
that hangs up cancels its group, and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tallyserve import LLM
from tallyserve.engine.beam_search import BeamSearchParams
from tests.server.live_server import API_KEY, MODEL, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world!"]
MESSAGES = [{"role": "user", "content": "Hello!"}]
MAX_TOKENS = 6
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _offline_beams(offline: LLM, prompts, width: int, length_penalty: float = 1.0):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty)
    return [out.sequences for out in offline.beam_search(prompts, params)]


def test_completion_beam_search_matches_offline(client, offline):
    tok = offline.get_tokenizer()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, n=3,
                                     extra_body={**BEAM, "best_of": 3})
    (ref,) = _offline_beams(offline, PROMPTS[1], 3)
    prompt_len = len(tok.encode(PROMPTS[1]))
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [s.text for s in ref]
    assert [c.finish_reason for c in resp.choices] == [s.finish_reason for s in ref]
    assert all(c.logprobs is None for c in resp.choices)
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == sum(len(s.tokens) - prompt_len for s in ref)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_n2_of_width3_returns_the_two_best_with_echo(client, offline):
    tok = offline.get_tokenizer()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, n=2, echo=True,
                                     extra_body={**BEAM, "best_of": 3})
    refs = _offline_beams(offline, PROMPTS, 3)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]  # prompt * n + rank
    expected = [p + s.text for p, ref in zip(PROMPTS, refs) for s in ref[:2]]
    assert [c.text for c in resp.choices] == expected
    lens = [len(tok.encode(p)) for p in PROMPTS]
    assert resp.usage.prompt_tokens == sum(lens)  # once per prompt, not per beam
    assert resp.usage.completion_tokens == sum(len(s.tokens) - n for n, ref in zip(lens, refs) for s in ref[:2])


def test_chat_beam_search_matches_offline(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, n=2,
                                          extra_body={**BEAM, "best_of": 3, "length_penalty": 0.5})
    ids = offline.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True)
    (ref,) = _offline_beams(offline, {"prompt_token_ids": ids}, 3, length_penalty=0.5)
    assert [c.message.content for c in resp.choices] == [s.text for s in ref[:2]]
    assert [c.finish_reason for c in resp.choices] == [s.finish_reason for s in ref[:2]]
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == sum(len(s.tokens) - len(ids) for s in ref[:2])


GOOD = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, **BEAM}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **BEAM}
# (name, path, body, the parameter the error names)
BAD = [
    ("best_of below n", "/v1/completions", {**GOOD, "n": 3, "best_of": 2}, "best_of"),
    ("best_of over 64 n", "/v1/completions", {**GOOD, "n": 2, "best_of": 129}, "best_of"),
    ("best_of over 64 n (chat)", "/v1/chat/completions", {**CHAT, "best_of": 65}, "best_of"),
    ("stream", "/v1/completions", {**GOOD, "stream": True}, "stream"),
    ("stream (chat)", "/v1/chat/completions", {**CHAT, "stream": True}, "stream"),
    ("temperature", "/v1/completions", {**GOOD, "temperature": 0.7}, "temperature"),
    ("temperature (chat)", "/v1/chat/completions", {**CHAT, "temperature": 1}, "temperature"),
    ("logprobs", "/v1/completions", {**GOOD, "logprobs": 1}, "logprobs"),
    ("logprobs (chat)", "/v1/chat/completions", {**CHAT, "logprobs": True}, "logprobs"),
    ("stop", "/v1/completions", {**GOOD, "stop": ["\n"]}, "stop"),
    ("stop (chat)", "/v1/chat/completions", {**CHAT, "stop": "x"}, "stop"),
    ("length_penalty as string", "/v1/completions", {**GOOD, "length_penalty": "1"}, "length_penalty"),
    # Each of these once reached beam scoring, raised there and killed the engine loop for good.
    ("length_penalty 1e308", "/v1/completions", {**GOOD, "best_of": 2, "length_penalty": 1e308}, "length_penalty"),
    ("length_penalty 2000", "/v1/completions", {**GOOD, "best_of": 2, "length_penalty": 2000}, "length_penalty"),
    ("length_penalty -1e308 (chat)", "/v1/chat/completions", {**CHAT, "length_penalty": -1e308}, "length_penalty"),
    ("more beams than the KV cache holds", "/v1/completions", {**GOOD, "best_of": 64, "max_tokens": 400}, "best_of"),
    ("best_of without beam search", "/v1/completions", {**GOOD, "use_beam_search": False, "best_of": 2}, "best_of"),
]


def test_bad_beam_search_requests_are_openai_400s(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as http:
        for name, path, body, param in BAD:
            r = http.post(path, json=body)
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["type"] == "invalid_request_error" and err["param"] == param, (name, err)
        r = http.post("/v1/completions", json={**GOOD, "stop": "x"})
        assert "stop strings are not supported with use_beam_search" in r.json()["error"]["message"]
        # The loop is alive: a valid beam search right after still answers, and health is green.
        ok = http.post("/v1/completions", json={**GOOD, "best_of": 2, "length_penalty": 10})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == GOOD.get("n", 1)
        assert http.get("/health").status_code == 200


def test_client_disconnect_cancels_the_group_and_frees_blocks(server):
    body = {**GOOD, "best_of": 4, "max_tokens": 480, "ignore_eos": True}  # hundreds of steps
    aborted = "tallyserve_requests_total{finish_reason=abort}"
    before = wait_idle(server.base_url)

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=30) as http:
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            deadline = time.monotonic() + 20
            while metrics(server.base_url)["tallyserve_num_requests_running"] == 0:
                assert not task.done() and time.monotonic() < deadline, "the beam search never ran"
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection: the server sees the client go
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(hang_up())
    m = wait_idle(server.base_url)
    assert m[aborted] == before[aborted] + 1  # cancelled, not run to the end
    assert m["tallyserve_num_requests_running"] == m["tallyserve_num_requests_waiting"] == 0
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"] == 256
    assert m["tallyserve_kv_blocks_in_use"] == 0
    assert m["tallyserve_ledger_violations_total"] == 0 and m["tallyserve_step_errors_total"] == 0
    assert m["tallyserve_engine_healthy"] == 1
