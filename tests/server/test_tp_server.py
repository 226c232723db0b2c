"""A live `tallyserve serve -tp 2` (two gloo worker processes under the server) answers the official
openai client, completions and chat, streaming and not, with the same greedy text as the TP=1
server and the offline engine. Then one worker is killed: the pending stream ends with an error, new
requests get 503, /health turns 503, and SIGTERM still ends the server with code 0 and no worker
left behind. The kill tests run last: they end their servers."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tallyserve import SamplingParams
from tests.server.live_server import API_KEY, MODEL, LiveServer

PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time, in a land far away"]
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
MAX_TOKENS = 16


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _spawned(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _worker_pids(server_pid: int, expect: int = 2, timeout: float = 10.0) -> list[int]:
    """The server's tensor-parallel workers: the processes multiprocessing's spawn started under the
    server that started none themselves (with the step loop in the engine core process, they are its
    children; in-thread, the server's)."""
    deadline = time.monotonic() + timeout
    while True:
        pids, todo = [], [server_pid]
        while todo:
            pid = todo.pop()
            kids = [c for c in _children(pid) if _spawned(c)]
            if pid != server_pid and not kids:
                pids.append(pid)
            todo += kids
        if len(pids) == expect or time.monotonic() > deadline:
            assert len(pids) == expect, pids
            return sorted(pids)
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """The pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _health(base_url: str) -> int:
    return httpx.get(base_url + "/health", timeout=5).status_code


def _wait_health(base_url: str, code: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _health(base_url) == code:
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"/health did not turn {code} within {timeout}s")


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def _start_tp_server(tiny_model_dir, server_logs) -> LiveServer:
    return LiveServer(tiny_model_dir, server_logs, "-tp", "2", "--served-model-name", MODEL, "--api-key", API_KEY)


def _stop_and_check_clean(srv: LiveServer, workers: list[int]) -> None:
    srv.terminate()
    code = srv.wait(20)
    assert code == 0, srv.log_tail()
    deadline = time.monotonic() + 5
    while any(_running(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _running(p)], "worker processes outlived the server"
    srv.stop()


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir, server_logs):
    srv = _start_tp_server(tiny_model_dir, server_logs)
    srv.workers = _worker_pids(srv.proc.pid)
    yield srv
    srv.stop()
    for p in srv.workers:  # never leave a worker behind, whatever a test did
        if _running(p):
            os.kill(p, signal.SIGKILL)


@pytest.fixture(scope="module")
def tp_client(tp_server):
    c = _client(tp_server)
    yield c
    c.close()


# ----------------------------------------------------------------- same greedy text as TP=1
def test_completions_match_tp1_and_offline(tp_client, client, offline):
    ref = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, want in zip(PROMPTS, ref):
        got = tp_client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == one.choices[0].text == want.outputs[0].text
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        stream = tp_client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True)
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert len(chunks) > 1 and "".join(chunks) == want.outputs[0].text


def test_chat_matches_tp1(tp_client, client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    got = tp_client.chat.completions.create(**kw)
    one = client.chat.completions.create(**kw)
    assert got.choices[0].message.content == one.choices[0].message.content
    assert got.usage.completion_tokens == one.usage.completion_tokens > 0
    parts = [c.choices[0].delta.content or "" for c in tp_client.chat.completions.create(stream=True, **kw)
             if c.choices]
    assert "".join(parts) == one.choices[0].message.content


# ----------------------------------------------------------------- a worker dies under the server
def test_killed_worker_fails_requests_and_health(tp_server, tp_client):
    base = tp_server.base_url
    assert _health(base) == 200
    first_chunk, outcome = threading.Event(), {}

    def pending() -> None:
        try:
            stream = tp_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
            n = 0
            for _ in stream:
                n += 1
                first_chunk.set()
            outcome["finished"] = n
        except Exception as exc:  # noqa: BLE001 - what the test checks
            outcome["error"] = exc

    t = threading.Thread(target=pending)
    t.start()
    assert first_chunk.wait(30), outcome
    assert not outcome, outcome  # streaming normally when the worker dies
    os.kill(tp_server.workers[1], signal.SIGKILL)
    t.join(20)
    assert not t.is_alive(), "the pending stream did not end after its worker died"
    assert "error" in outcome, outcome  # not a normal end of 400 tokens
    assert isinstance(outcome["error"], openai.APIError), repr(outcome["error"])

    _wait_health(base, 503, 60.0)  # bounded: fails only if /health never turns
    assert "engine" in httpx.get(base + "/health", timeout=5).text.lower()
    with pytest.raises(openai.APIStatusError) as err:
        tp_client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert err.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as err:
        tp_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True)
    assert err.value.status_code == 503
    # the surviving worker was taken down by the executor, not left running
    deadline = time.monotonic() + 10
    while any(_running(p) for p in tp_server.workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tp_server.workers if _running(p)]
    _stop_and_check_clean(tp_server, tp_server.workers)


def test_idle_server_notices_a_dead_worker(tiny_model_dir, server_logs):
    """No request in flight: /health must still turn 503 once a worker is gone, and new requests
    get 503 (not a hang and not a 500)."""
    srv = _start_tp_server(tiny_model_dir, server_logs)
    workers = _worker_pids(srv.proc.pid)
    try:
        with _client(srv) as c:
            assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0).choices[0].text
            os.kill(workers[0], signal.SIGKILL)
            _wait_health(srv.base_url, 503, 60.0)
            with pytest.raises(openai.APIStatusError) as err:
                c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
            assert err.value.status_code == 503
        _stop_and_check_clean(srv, workers)
    finally:
        srv.stop()
        for p in workers:
            if _running(p):
                os.kill(p, signal.SIGKILL)
