"""The server with its step loop in the engine core process (--enable-frontend-multiprocessing):
through the official openai client its greedy outputs (completions and chat, streamed and not,
logprobs and beam search included) equal the in-thread server's; a client that disconnects aborts
its request (the engine stops computing it, every KV block comes back); bad input still gets
OpenAI-style 400s; killing the engine core process ends in-flight streams with an error and turns
/health 503; the server never leaves the engine core process behind (SIGTERM or SIGKILL).

No wall-clock bounds: waits for what the engine core must do are bounded (WAIT_S) and fail only on a hang."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL, LiveServer, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world!"]
CHAT = [{"role": "user", "content": "Tell me a story."}]
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
        "stream": True}
WAIT_S = 30


@pytest.fixture(scope="module")
def proc_server(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--api-key", API_KEY,
                     "--trust-request-chat-template", "--enable-frontend-multiprocessing")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def thread_server(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--api-key", API_KEY,
                     "--trust-request-chat-template", "--disable-frontend-multiprocessing")
    yield srv
    srv.stop()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _engine_core_pid(server: LiveServer) -> int:
    cores = [c for c in _children(server.proc.pid)
             if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, f"expected one engine core process, found {cores}"
    return cores[0]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has stopped running (its reaper may be slow in a container)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return _gone(pid)


def _completions(c: openai.OpenAI, stream: bool) -> list[tuple[str, list]]:
    out = []
    for p in PROMPTS:
        kw = dict(model=MODEL, prompt=p, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        if stream:
            text, lps = "", []
            for chunk in c.completions.create(stream=True, **kw):
                for ch in chunk.choices:
                    text += ch.text
                    lps += ch.logprobs.tokens if ch.logprobs is not None else []
            out.append((text, lps))
        else:
            ch = c.completions.create(**kw).choices[0]
            out.append((ch.text, ch.logprobs.tokens))
    return out


def _chat(c: openai.OpenAI, stream: bool) -> str:
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    return c.chat.completions.create(**kw).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_outputs_equal_the_in_thread_server(proc_server, thread_server, stream):
    proc, thread = _client(proc_server), _client(thread_server)
    got = _completions(proc, stream)
    assert got == _completions(thread, stream)
    assert all(len(lps) == 12 for _, lps in got)  # every token's logprob came across
    assert _chat(proc, stream) == _chat(thread, stream)
    n2 = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2, temperature=0, extra_body={"ignore_eos": True})
    assert [ch.text for ch in proc.completions.create(**n2).choices] == \
        [ch.text for ch in thread.completions.create(**n2).choices]


def test_beam_search_is_forwarded(proc_server, thread_server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "n": 2, "use_beam_search": True}
    got = httpx.post(proc_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    want = httpx.post(thread_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert got.status_code == 200, got.text
    assert [c["text"] for c in got.json()["choices"]] == [c["text"] for c in want.json()["choices"]]


def test_client_disconnect_aborts_and_frees_every_block(proc_server):
    before = wait_idle(proc_server.base_url)["tallyserve_scheduled_tokens_total"]
    chunks = 0
    with httpx.Client(base_url=proc_server.base_url, headers=AUTH, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=LONG) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # closing the response drops the connection
    m = wait_idle(proc_server.base_url)
    assert m["tallyserve_kv_blocks_in_use"] == 0 and m["tallyserve_num_requests_running"] == 0
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"] > 0
    # Aborted, not run to its 480 tokens: the engine scheduled the prompt and a few decode steps.
    assert m["tallyserve_scheduled_tokens_total"] - before < 240


def test_bad_input_gets_openai_400s(proc_server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(proc_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30)

    cases = [
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 99}, "logprobs"),
        ({"model": MODEL, "prompt": "hi " * 600, "max_tokens": 4}, None),  # longer than max_model_len 512
        ({"model": MODEL, "prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ]
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param
    r = post({"model": "no-such-model", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(proc_server.base_url + "/health", timeout=5).status_code == 200  # nothing broke
    assert wait_idle(proc_server.base_url)["tallyserve_kv_blocks_in_use"] == 0


def test_metrics_and_health_come_from_the_engine_core(proc_server):
    c = _client(proc_server)
    c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    m = wait_idle(proc_server.base_url)
    assert m["tallyserve_engine_alive"] == 1 and m["tallyserve_engine_healthy"] == 1
    assert m["tallyserve_engine_steps_total"] > 0 and m["tallyserve_tokens_per_step_count"] > 0
    assert _idle_heartbeat_advances(proc_server.base_url)  # the idle loop's heartbeat crosses the process boundary


def _idle_heartbeat_advances(base_url: str) -> bool:
    """Whether /health's last-step time moves on while nothing runs (the engine core's idle loop beats, and the
    server reads it): a later probe's heartbeat is newer than an earlier one's, on the test's clock. Bounded."""
    def beat() -> tuple[float, float]:  # (earliest, latest) test-clock time the heartbeat can have been at
        before = time.monotonic()
        body = httpx.get(base_url + "/health", timeout=WAIT_S).json()
        assert body["status"] == "ok", body
        return before - body["seconds_since_last_step"] - 0.001, time.monotonic() - body["seconds_since_last_step"]

    _, first_latest = beat()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if beat()[0] > first_latest:
            return True
    return False


def test_sigterm_stops_the_engine_core_process(proc_server):
    """Runs last in this module: it stops the shared server."""
    core = _engine_core_pid(proc_server)
    proc_server.terminate()
    assert proc_server.wait(WAIT_S) == 0
    assert _wait_gone(core, WAIT_S), "the engine core process outlived the server"


def test_killing_the_engine_core_ends_streams_and_fails_health(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--enable-frontend-multiprocessing")
    try:
        core = _engine_core_pid(srv)
        events: list[str] = []
        with httpx.Client(base_url=srv.base_url, timeout=WAIT_S) as client:  # bounded: fails only on a hang
            with client.stream("POST", "/v1/completions", json=LONG) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                os.kill(core, signal.SIGKILL)
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
            health = client.get("/health")
            new = client.post("/v1/completions", json={**LONG, "stream": False})
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        chunks = [json.loads(e) for e in events[:-2]]  # ended by the death, not by running its 480 tokens
        assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))
        assert health.status_code == 503 and "engine core process died" in health.json()["reason"]
        assert new.status_code == 503 and new.json()["error"]["type"] == "server_error"
        assert metrics(srv.base_url)["tallyserve_engine_alive"] == 0
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_killed_server_leaves_no_engine_core_behind(tiny_model_dir, server_logs):
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--enable-frontend-multiprocessing")
    try:
        core = _engine_core_pid(srv)
        srv.proc.kill()  # SIGKILL: no shutdown code runs in the server
        srv.wait(10)
        assert _wait_gone(core, WAIT_S), "the engine core process outlived a killed server"
    finally:
        srv.stop()


def test_health_of_a_running_step_comes_from_the_engine_core(tiny_model_dir):
    """No HTTP: the running step's start and tokens and the learned seconds per token reach the
    server process from the engine core's shared memory, so a stalled step turns health red while it
    runs, and a finished one turns it green again. The stall lasts its step's limit (computed from the
    learned seconds per token) plus 1.5 s, so it is stalled for that long on any machine."""
    import asyncio

    from tallyserve import SamplingParams
    from tallyserve.config import EngineArgs
    from tallyserve.engine.async_engine import AsyncLLMEngine
    from tallyserve.engine.errors import FaultKind
    from tallyserve.engine.health import SEED_SECONDS_PER_TOKEN, STALL_FACTOR

    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, num_gpu_blocks_override=64, block_size=8),
                                          frontend_multiprocessing=True, stall_timeout=0.5)
    eng.start()

    async def final(rid: str, prompt):
        last = None
        async for out in eng.generate(rid, prompt, greedy):
            last = out
        return last

    stalled_prompt = {"prompt_token_ids": [101, 102, 103, 104, 105]}  # no prefix hit: all its prompt computed

    async def run():
        warm = await final("warm", PROMPTS[0])
        limit = 0.5 + STALL_FACTOR * eng.health().seconds_per_token * len(stalled_prompt["prompt_token_ids"])
        eng.inject_fault(FaultKind.STALL, limit + 1.5)
        task = asyncio.create_task(final("stalled", stalled_prompt))
        samples = []
        while not task.done():
            samples.append(eng.health())
            await asyncio.sleep(0.05)
        return warm, await task, samples, limit

    try:
        warm, out, samples, limit = asyncio.run(asyncio.wait_for(run(), 120))
        assert len(warm.outputs[0].token_ids) == len(out.outputs[0].token_ids) == 4
        running = [h for h in samples if h.step_running_s is not None]
        assert max(h.step_tokens for h in running) == len(out.prompt_token_ids) == 5  # the stalled prefill's
        held = [h for h in running if h.step_tokens == 5]  # (its decode steps, of one token each, may be seen too)
        assert max(h.step_running_s for h in held) > limit
        assert held[0].step_limit_s == pytest.approx(limit)  # the prediction the server sees is the engine's
        assert any(h.stalled and h.pending == 1 for h in running)
        assert eng.health().seconds_per_token != SEED_SECONDS_PER_TOKEN  # learned in the engine core
        assert eng.health().healthy and eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    finally:
        eng.shutdown()
    assert not eng.core.proc.is_alive() and eng.core.proc.exitcode == 0


def test_the_engine_core_process_is_the_default(api_server, thread_server):
    assert _engine_core_pid(api_server) > 0  # the shared server runs with no mode flag
    assert not [c for c in _children(thread_server.proc.pid)
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_disaggregated_serving_asks_for_the_thread(tiny_model_dir, capsys):
    from tallyserve.cli import main

    kv = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    assert main(["serve", "--model", tiny_model_dir, "--enable-frontend-multiprocessing",
                 "--kv-transfer-config", kv]) == 2
    assert "needs the in-thread engine" in capsys.readouterr().err


def test_bad_engine_arguments_are_a_clean_error(tmp_path, capfd):
    """As in-thread: the engine core's ValueError becomes `tallyserve: error: ...` and exit code 2."""
    from tallyserve.cli import main

    missing = str(tmp_path / "no-such-model")
    assert main(["serve", "--model", missing, "--enable-frontend-multiprocessing"]) == 2
    err = capfd.readouterr().err  # the engine core's stderr too
    assert f"tallyserve: error: model '{missing}' does not exist" in err and "Traceback" not in err
