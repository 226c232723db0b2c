"""Hostile-input hygiene on live servers: invalid Unicode is a 400 naming the field; connections
stay usable after errors (a 500 included); error messages quote little of the input; bodies over
the limit get 413 before they are read; big prompts are tokenized off the event loop; half-open
connections neither exhaust file descriptors nor linger; the OpenAPI schema and docs tell the
truth; every 429 has Retry-After. Afterwards every KV block is free.

"/health still answers" means a 200 within a generous timeout, not a latency bound a loaded machine can
miss; a timeout the server enforces is checked from below (nothing closed before it) and waited for,
bounded, from above."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.server.live_server import API_KEY, HOST, MODEL, LiveServer, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
BODY_LIMIT = 3_000_000
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
LOW_SOFT_NOFILE = 256
HALF_OPEN = 300  # more than LOW_SOFT_NOFILE
STALL_TIMEOUT_S = 0.5
GOOD = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 4, "temperature": 0}
WAIT_S = 60  # bound on waits for what the server must do (fails only on a hang)


@pytest.fixture(scope="module")
def server(api_server):
    """The shared server (with --api-key)."""
    return api_server


@pytest.fixture(scope="module")
def hostile(tiny_model_dir, server_logs):
    """A server started with a low soft open-file limit, short header and body timeouts, a small body limit,
    a one-request queue, a short stall timeout, fault injection and no docs."""
    def low_nofile() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(LOW_SOFT_NOFILE, hard), hard))

    popen = subprocess.Popen
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", lambda *a, **kw: popen(*a, preexec_fn=low_nofile, **kw))
        srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--enable-fault-injection",
                         "--max-queue-len", "1", "--header-timeout", str(HEADER_TIMEOUT_S), "--disable-docs",
                         "--body-timeout", str(BODY_TIMEOUT_S),
                         "--max-request-body-bytes", str(BODY_LIMIT), "--stall-timeout", str(STALL_TIMEOUT_S))
    yield srv
    srv.stop()


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def _health_ok(base_url: str) -> None:
    """/health answers, and 200 (bounded: fails only if the server does not answer at all)."""
    r = httpx.get(base_url + "/health", timeout=WAIT_S)
    assert r.status_code == 200, r.text


def _connect(srv: LiveServer) -> socket.socket:
    return socket.create_connection((HOST, srv.port), timeout=10)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body (by Content-Length) of one raw HTTP/1.1 response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


# ----------------------------------------------------------------------------- the shared server

UNICODE_CASES = [
    ("prompt escape", "/v1/completions", b'{"model": "tiny", "prompt": "abc\\ud800def"}', "prompt"),
    ("prompt list escape", "/v1/completions", b'{"model": "tiny", "prompt": ["ok", "abc\\udfffdef"]}', "prompt"),
    ("prompt raw bytes", "/v1/completions", b'{"model": "tiny", "prompt": "abc\xed\xa0\x80def"}', "prompt"),
    ("stop escape", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["abc\\ud800def"]}', "stop"),
    ("model escape", "/v1/completions", b'{"model": "abc\\ud800def", "prompt": "hi"}', "model"),
    ("chat content escape", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "abc\\ud800def"}]}', "messages"),
    ("chat content raw bytes", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "abc\xed\xa0\x80def"}]}', "messages"),
    ("chat role escape", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "us\\ud800er", "content": "hi"}]}', "messages"),
    ("chat model escape", "/v1/chat/completions",
     b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
]


@pytest.mark.parametrize("name,path,body,param", UNICODE_CASES, ids=[c[0] for c in UNICODE_CASES])
def test_invalid_unicode_is_a_400_naming_the_field(server, name, path, body, param):
    r = httpx.post(server.base_url + path, content=body, headers={**AUTH, **JSON}, timeout=30)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "Unicode" in err["message"]


def test_errors_quote_at_most_a_little_of_the_input(server):
    huge = "m" * 1_000_000
    cases = [
        ("/v1/completions", {**GOOD, "model": huge}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": huge, "content": "hi"}]}, 400, "messages"),
        ("/v1/completions", {**GOOD, "logit_bias": {huge: "not a number"}}, 400, None),
        ("/v1/completions", {**GOOD, "prompt": [1, 10 ** 4000]}, 400, "prompt"),
    ]
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as client:
        for path, body, status, param in cases:
            r = client.post(path, json=body)
            assert r.status_code == status, r.text[:300]
            assert len(r.content) < 2048, r.text[:300]
            if param is not None:
                assert r.json()["error"]["param"] == param
        r = client.post("/v1/completions", json={**GOOD, "model": huge})
        assert "1000000 characters" in r.json()["error"]["message"]


def test_connection_is_reused_after_400_401_and_404(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as client:
        first = client.get("/v1/models")
        port = _local_port(first)
        for r in (client.post("/v1/completions", json={**GOOD, "max_tokens": -1}),
                  client.post("/v1/completions", json={**GOOD, "model": "gpt-9"}),
                  client.get("/v1/nothing-here"),
                  client.get("/v1/models", headers={"Authorization": "Bearer nope"}),
                  client.post("/v1/completions", content=b"{", headers=JSON)):
            assert r.status_code in (400, 401, 404) and "close" not in r.headers.get("connection", "")
            assert _local_port(r) == port
        ok = client.post("/v1/completions", json=GOOD)
        assert ok.status_code == 200 and _local_port(ok) == port


def test_docs_need_the_api_key(server):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        r = httpx.get(server.base_url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.get(server.base_url + path, headers=AUTH, timeout=10).status_code == 200, path


def test_openapi_documents_what_the_server_returns(server):
    schema = httpx.get(server.base_url + "/openapi.json", headers=AUTH, timeout=10).json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in schema["components"]["schemas"]
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503"}, path
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, status)
        assert "Retry-After" in responses["429"]["headers"]
    error = schema["components"]["schemas"]["ErrorInfo"]["properties"]
    assert set(error) == {"message", "type", "param", "code"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in paths["/health"]["get"]["responses"]
    assert "401" in paths["/v1/models"]["get"]["responses"]


# ----------------------------------------------------------------------------- the hostile server


def test_half_open_connections_over_the_soft_fd_limit(hostile):
    """More half-open connections than the soft open-file limit the server started with: /health
    still answers (the server raised its limit), and the header timeout closes them all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * HALF_OPEN:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for this test")
    if soft < 2 * HALF_OPEN:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2 * HALF_OPEN, hard))  # this process opens HALF_OPEN too
    socks = []
    try:
        opened = time.monotonic()
        for _ in range(HALF_OPEN):
            s = _connect(hostile)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x")  # no end of headers, ever
            socks.append(s)
        for _ in range(3):
            _health_ok(hostile.base_url)
        closed, saw_408 = 0, False
        for s in socks:
            s.settimeout(max(0.1, opened + HEADER_TIMEOUT_S + WAIT_S - time.monotonic()))
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            saw_408 = saw_408 or data.startswith(b"HTTP/1.1 408")
            closed += 1
        elapsed = time.monotonic() - opened
    finally:
        for s in socks:
            s.close()
    assert closed == HALF_OPEN and saw_408
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed  # not closed before the header timeout (and all closed, bounded)
    _health_ok(hostile.base_url)


def test_slow_bodies_over_the_soft_fd_limit_get_408(hostile):
    """More slow-body connections (complete headers, Content-Length 1000, 10 bytes, then silence)
    than the soft open-file limit the server started with: /health still answers, and each slow
    body gets its 408 and a closed connection once the body timeout passes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * HALF_OPEN:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for this test")
    if soft < 2 * HALF_OPEN:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2 * HALF_OPEN, hard))
    socks = []
    try:
        opened = time.monotonic()
        for _ in range(HALF_OPEN):
            s = _connect(hostile)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
            socks.append(s)
        for _ in range(3):
            _health_ok(hostile.base_url)
        answers = []
        for s in socks:
            s.settimeout(max(0.1, opened + BODY_TIMEOUT_S + WAIT_S - time.monotonic()))
            data = b""
            while chunk := s.recv(4096):  # the server closes the connection after its 408
                data += chunk
            answers.append(data.split(b"\r\n", 1)[0])
        elapsed = time.monotonic() - opened
    finally:
        for s in socks:
            s.close()
    assert answers == [b"HTTP/1.1 408 Request Timeout"] * HALF_OPEN
    assert BODY_TIMEOUT_S * 0.9 <= elapsed  # not answered before the body timeout (and all answered, bounded)
    _health_ok(hostile.base_url)


def test_500_keeps_the_connection_usable(hostile):
    with httpx.Client(base_url=hostile.base_url, timeout=30) as client:
        port = _local_port(client.get("/health"))
        r = client.post("/debug/fault", json={"kind": "handler_exception"})
        assert r.status_code == 500 and "close" not in r.headers.get("connection", "")
        assert r.json()["error"] == {"message": "internal server error: RuntimeError: injected handler exception",
                                     "type": "server_error", "param": None, "code": "internal_error"}
        assert _local_port(r) == port
        after = client.post("/v1/completions", json=GOOD)
        assert after.status_code == 200 and _local_port(after) == port


def test_body_over_the_limit_gets_413_before_it_is_read(hostile):
    # Content-Length over the limit: answered from the headers, with no body sent at all (had the server waited
    # for the body, the body timeout would have answered 408).
    with _connect(hostile) as s:
        s.settimeout(WAIT_S)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{\"prompt\": \"")
        status, headers, body = _read_response(s)
        _health_ok(hostile.base_url)  # while that connection is still open
    err = json.loads(body)["error"]
    assert status == 413 and headers["connection"] == "close"
    assert set(err) == {"message", "type", "param", "code"} and "1000000000 bytes" in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    # Chunked: counted as it arrives; the 413 comes although the body never ends.
    chunk = b"x" * 65536
    with _connect(hostile) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(BODY_LIMIT // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if i == 10:
                _health_ok(hostile.base_url)
        status, headers, body = _read_response(s)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # A chunked body under the limit is served as usual.
    r = httpx.post(hostile.base_url + "/v1/completions", content=iter([json.dumps(GOOD).encode()]),
                   headers=JSON, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_large_prompts_are_tokenized_off_the_event_loop(hostile):
    text = ("The quick brown fox jumps over the lazy dog. " * 60_000)[:2_500_000]
    bodies = [("/v1/completions", {**GOOD, "prompt": text}),
              ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text[:1_000_000]}]})]
    for path, body in bodies:
        result: dict = {}

        def post() -> None:
            t0 = time.monotonic()
            result["r"] = httpx.post(hostile.base_url + path, json=body, timeout=WAIT_S)
            result["took"] = time.monotonic() - t0

        t = threading.Thread(target=post)
        t.start()
        latencies = []
        while t.is_alive():
            t0 = time.monotonic()
            _health_ok(hostile.base_url)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.01)
        t.join()
        err = result["r"].json()["error"]
        assert result["r"].status_code == 400 and err["code"] == "context_length_exceeded", err
        # Tokenizing is most of the request's time: on the event loop, a probe sent while it runs would wait for
        # the rest of it, and few probes would be answered meanwhile. Off it, probes keep being answered, each in
        # a small part of the request's time (both scale with the machine's speed and load).
        assert len(latencies) >= 3 and max(latencies) < result["took"] / 2, (path, result["took"], latencies)


def test_docs_can_be_disabled(hostile):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        r = httpx.get(hostile.base_url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path


def _wait_health(base_url: str, status: int, while_alive: threading.Thread = None) -> bool:
    """Poll /health until it answers `status` (while `while_alive` still runs, if given); bounded by WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while httpx.get(base_url + "/health", timeout=WAIT_S).status_code != status:
        if time.monotonic() > deadline or (while_alive is not None and not while_alive.is_alive()):
            return False
        time.sleep(0.05)
    return True


def test_every_429_has_retry_after(hostile):
    # the stalled request's first step schedules one token: its limit (stall timeout + 8x one token's predicted
    # time) passes well before the 3 s stall ends, on any machine
    one = {**GOOD, "prompt": [42]}
    assert httpx.post(hostile.base_url + "/debug/fault", json={"kind": "stall", "seconds": 3.0}).status_code == 200

    def post(out: list, body: dict = GOOD) -> None:
        out.append(httpx.post(hostile.base_url + "/v1/completions", json=body, timeout=WAIT_S))

    first: list = []
    threads = [threading.Thread(target=post, args=(first, one))]
    threads[0].start()
    # Its step now sleeps; once the loop counts as stalled, one more request may wait, the rest are refused.
    assert _wait_health(hostile.base_url, 503, while_alive=threads[0])
    rest: list = []
    threads += [threading.Thread(target=post, args=(rest,)) for _ in range(4)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    limited = [r for r in first + rest if r.status_code == 429]
    assert limited and {r.status_code for r in first + rest} <= {200, 429}
    for r in limited:
        assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert _wait_health(hostile.base_url, 200)


def test_no_kv_blocks_leak(server, hostile):
    for srv in (server, hostile):
        m = wait_idle(srv.base_url)
        assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"]
        assert m["tallyserve_ledger_violations_total"] == 0
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
