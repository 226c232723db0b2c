"""Backpressure: a stream buffers one cumulative output, not one per step (a client that does not
read costs bounded memory); a client that does not read for --slow-client-timeout is cut off (its
request aborted, its blocks freed, the connection closed, the abort counted); a reading client still
gets every token exactly once; --max-queue-len counts requests waiting in the scheduler, so a burst
against an idle server is admitted."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tallyserve.engine.async_engine import _OutputQueue
from tallyserve.outputs import CompletionOutput, RequestOutput
from tests.server.live_server import HOST, MODEL, LiveServer, metrics, wait_idle
from tests.server.test_async_engine import LONG, PROMPTS, _engine, _wait_idle
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

# Loopback TCP absorbs about 3 MB per connection (the server's autotuned send buffer) before
# uvicorn's flow control holds a send, so an unread stream must be much longer than that: 32
# choices x 1,000 tokens (~180 bytes of SSE each) is ~5.7 MB, and without coalescing the queued
# cumulative outputs of its last ~500 steps hold ~100 MB per stream.
N_CHOICES = 32
UNREAD_TOKENS = 1000
UNREAD = {"model": MODEL, "prompt": "Once upon a time", "n": N_CHOICES, "max_tokens": UNREAD_TOKENS,
          "temperature": 0, "ignore_eos": True, "stream": True}
RSS_GROWTH_LIMIT_MB = 64  # two unread streams; without coalescing they add 200+ MB
MAX_QUEUE_LEN = 8
# Two unread requests of 32 x (prompt + 1,000) tokens, with room to spare.
SERVER_ARGS = ("--served-model-name", MODEL, "--num-gpu-blocks-override", "8600", "--max-queue-len",
               str(MAX_QUEUE_LEN))


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with room for long generations (one layer, one KV head: a small KV cache)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", seed=0, max_position_embeddings=2048,
                           num_hidden_layers=1, num_key_value_heads=1)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(long_model_dir, server_logs):
    srv = LiveServer(long_model_dir, server_logs, *SERVER_ARGS)
    yield srv
    srv.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _unread_stream(port: int, body: dict) -> socket.socket:
    """A streaming request on a raw socket with a small receive buffer, which is never read."""
    payload = json.dumps(body).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((HOST, port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return s


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _output(text: str, finished: bool = False, error=None) -> RequestOutput:
    o = CompletionOutput(0, text, list(range(len(text))), None, None, "length" if finished else None)
    return RequestOutput("r", None, [1], [o], finished, error=error)


def test_output_queue_coalesces_cumulative_outputs_only():
    async def run():
        q = _OutputQueue()
        q.put_nowait(_output("a"))
        q.put_nowait(_output("ab"))  # replaces "a"
        failed = _output("ab", finished=True, error="boom")
        q.put_nowait(failed)  # never replaced, never replaces
        q.put_nowait(_output("abc"))
        q.put_nowait(_output("abcd", finished=True))  # the final output replaces "abc"
        q.put_nowait(_output("abcde"))  # never replaces a final one
        exc = RuntimeError("dead")
        q.put_nowait(exc)
        q.put_nowait(_output("x"))
        return [q.get_nowait() for _ in range(q.qsize())], failed, exc

    items, failed, exc = asyncio.run(run())
    assert len(items) == 6 and items[1] is failed and items[4] is exc
    assert [items[i].outputs[0].text for i in (0, 2, 3, 5)] == ["ab", "abcd", "abcde", "x"]
    assert items[2].finished and not items[3].finished


def test_unread_stream_holds_one_output(tiny_model_dir):
    """The engine runs a request to the end while its consumer does not read: the stream then
    holds the final output only, and its text equals a stream read as it goes."""
    eng = _engine(tiny_model_dir)

    async def run():
        texts = []
        async for out in eng.generate("read", PROMPTS[0], LONG):
            texts.append(out.outputs[0].text)
        gen = eng.generate("unread", PROMPTS[0], LONG)
        first = await gen.__anext__()
        while eng.stats()["num_running"] or eng.stats()["num_waiting"]:  # the engine runs it to the end
            await asyncio.sleep(0.05)
        stats = await _wait_idle(eng)
        rest = [out async for out in gen]
        return texts, first, stats, rest

    try:
        texts, first, stats, rest = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        eng.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not first.finished and len(rest) == 1 and rest[0].finished
    assert rest[0].outputs[0].text == texts[-1] and len(rest[0].outputs[0].token_ids) == LONG.max_tokens


def test_unread_streams_do_not_pile_up_memory(server):
    """Two raw-socket streams of ~5.7 MB that are never read: the engine finishes them, the
    server's sends stay held (nothing counted as finished), RSS grows by less than the limit, and
    closing the sockets ends them."""
    url, pid = server.base_url, server.proc.pid
    before = metrics(url)
    rss_before = _rss_mb(pid)
    socks = [_unread_stream(server.port, UNREAD) for _ in range(2)]
    try:
        _wait_for(lambda: metrics(url)["tallyserve_num_requests_running"] > 0, 30, "the streams to start")
        m = wait_idle(url, timeout=120)
        assert m["tallyserve_kv_blocks_in_use"] == 0 and m["tallyserve_num_requests_running"] == 0
        generated = m["tallyserve_scheduled_tokens_total"] - before["tallyserve_scheduled_tokens_total"]
        assert generated >= 2 * N_CHOICES * UNREAD_TOKENS  # the engine produced every token
        # The SSE side is still held by flow control: neither stream got to its end.
        length = "tallyserve_requests_total{finish_reason=length}"
        assert m[length] == before[length]
        growth = _rss_mb(pid) - rss_before
        print(f"RSS {rss_before:.1f} MB -> +{growth:.1f} MB with two unread streams")
        assert growth < RSS_GROWTH_LIMIT_MB, f"RSS grew by {growth:.1f} MB"
    finally:
        for s in socks:
            s.close()
    # Its sends released by the disconnect, each stream ends (as "length", or "abort" if cancelled first).
    ended = ("tallyserve_requests_total{finish_reason=length}", "tallyserve_requests_total{finish_reason=abort}")
    _wait_for(lambda: sum(metrics(url)[k] - before[k] for k in ended) == 2 * N_CHOICES, 30, "the streams to end")
    assert wait_idle(url)["tallyserve_kv_blocks_in_use"] == 0


def test_streaming_client_gets_every_token_once(server):
    """Two prompts x n=2 (four choices through `merged`): the concatenated deltas of each choice
    equal the non-streamed greedy text."""
    body = {"model": MODEL, "prompt": ["Once upon a time", "Hello, world!"], "n": 2, "max_tokens": 150,
            "temperature": 0, "ignore_eos": True}
    ref = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    expected = {c["index"]: c["text"] for c in ref["choices"]}
    got = {i: "" for i in expected}
    finish = {}
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                got[c["index"]] += c["text"]
                if c["finish_reason"] is not None:
                    finish[c["index"]] = c["finish_reason"]
    assert len(expected) == 4 and all(len(t) > 50 for t in expected.values())
    assert got == expected and finish == {i: "length" for i in expected}


def test_burst_against_idle_server_is_admitted(server):
    """100 concurrent requests with --max-queue-len 8: the scheduler runs them all at once (256
    sequences, blocks to spare), so none waits and none gets a 429."""
    body = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 4, "temperature": 0}

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(100)))

    codes = [r.status_code for r in asyncio.run(asyncio.wait_for(run(), 60))]
    assert codes == [200] * 100, {c: codes.count(c) for c in set(codes)}
    assert wait_idle(server.base_url)["tallyserve_kv_blocks_in_use"] == 0


def test_slow_client_is_cut_off(long_model_dir, server_logs):
    """--slow-client-timeout 2: a stream whose client stops reading is aborted a couple of seconds
    after its sends stall, before the engine finishes it; its blocks are freed, the connection is
    closed (reading it then ends without [DONE]) and the abort is counted."""
    srv = LiveServer(long_model_dir, server_logs, *SERVER_ARGS, "--slow-client-timeout", "2")
    try:
        url = srv.base_url
        s = _unread_stream(srv.port, {**UNREAD, "max_tokens": 1900})
        t0 = time.monotonic()
        _wait_for(lambda: metrics(url).get("tallyserve_slow_client_aborts_total", 0) == 1, 60, "the slow client abort")
        took = time.monotonic() - t0
        m = wait_idle(url)
        assert m["tallyserve_kv_blocks_in_use"] == 0 and m["tallyserve_num_requests_running"] == 0
        assert m["tallyserve_scheduled_tokens_total"] < N_CHOICES * 1900  # cut short, not run to the end
        assert m["tallyserve_requests_total{finish_reason=abort}"] == N_CHOICES
        s.settimeout(10)
        received = bytearray()
        while chunk := s.recv(1 << 16):  # the rest of what was sent, then EOF: the server closed it
            received += chunk
        s.close()
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        assert "Exception in ASGI application" not in srv.log_tail(200)  # the transport was aborted cleanly
        print(f"slow client cut off {took:.1f}s after its request, {len(received) / 1e6:.1f} MB delivered")
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()
