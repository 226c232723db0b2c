"""Grammar compiles cannot starve the server (both frontend modes): constraints over a limit are
400s naming it; huge schemas whose clients leave are cancelled while a small schema is answered
within seconds and /health stays 200; a compile past its deadline is a 400; SIGTERM during a
long compile ends the process within the drain timeout plus 5 s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.live_server import MODEL, LiveServer, metrics

DRAIN_TIMEOUT_S = 2.0
COMPILE_TIMEOUT_S = 4.0
# About 1.5 MB: compiles for many minutes. The servers here take it (raised size limits) so that
# its compile really starts; the default limits refuse it at once.
HUGE = {"type": "string", "enum": [f"enum value number {i:06d} of the hostile schema" for i in range(30_000)]}
SMALL = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
RSS_GROWTH_BOUND = 300 << 20


def _body(schema: dict, max_tokens: int = 8) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Give me JSON"}], "max_tokens": max_tokens,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _until_compiling(base_url: str, still=lambda: True) -> bool:
    """Poll /metrics until a grammar compile runs (while `still()` holds); bounded by 60 s."""
    deadline = time.monotonic() + 60
    while metrics(base_url)["tallyserve_structured_output_compiles_running"] < 1:
        if time.monotonic() > deadline or not still():
            return False
        time.sleep(0.02)
    return True


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module", params=["process", "thread"])
def server(request, tiny_model_dir, server_logs):
    mode = [] if request.param == "process" else ["--disable-frontend-multiprocessing"]
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, *mode,
                     "--drain-timeout", str(DRAIN_TIMEOUT_S),
                     "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S),
                     "--structured-outputs-max-schema-bytes", "4000000",
                     "--structured-outputs-max-enum-values", "1000000")
    yield srv
    srv.stop()


def test_limits_are_400s_naming_them(api_server):
    """The shared server runs with the default limits."""
    cases = [(HUGE, "--structured-outputs-max-schema-bytes"),
             ({"type": "string", "enum": [str(i) for i in range(1001)]}, "--structured-outputs-max-enum-values"),
             ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}, "'not'"),
             ({"$ref": "https://example.com/schema.json"}, "remote $ref")]
    before = metrics(api_server.base_url)
    with httpx.Client(base_url=api_server.base_url, timeout=30,
                      headers={"Authorization": "Bearer test-key-123"}) as c:
        for schema, words in cases:
            r = c.post("/v1/chat/completions", json=_body(schema))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == "response_format"
        choice = {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_choice": [str(i) for i in range(1001)]}
        r = c.post("/v1/completions", json=choice)
        assert r.status_code == 400 and "1001 choices" in r.json()["error"]["message"]
    after = metrics(api_server.base_url)
    # refused before compiling: no compile ran for any of them
    assert after["tallyserve_structured_output_compile_seconds_count"] == \
        before["tallyserve_structured_output_compile_seconds_count"]
    assert after["tallyserve_structured_output_compiles_running"] == 0


def test_huge_schemas_whose_clients_leave_cannot_starve_a_small_one(server):
    pid = server.proc.pid
    rss_before = _rss(pid)

    def attacker() -> None:
        try:
            httpx.post(server.base_url + "/v1/chat/completions", json=_body(HUGE), timeout=1.0)
        except httpx.TimeoutException:
            pass  # the client gives up after 1 s and closes its connection

    attackers = [threading.Thread(target=attacker) for _ in range(2)]
    for t in attackers:
        t.start()
    assert _until_compiling(server.base_url, lambda: any(t.is_alive() for t in attackers)), \
        "the huge compile never started"
    t0 = time.monotonic()
    r = httpx.post(server.base_url + "/v1/chat/completions", json=_body(SMALL, 16), timeout=60)
    small_s = time.monotonic() - t0
    for t in attackers:
        t.join()
    assert r.status_code == 200, r.text
    assert small_s < 15.0, f"the small schema waited {small_s:.1f} s"
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 10
    while metrics(server.base_url)["tallyserve_structured_output_compiles_running"] > 0:
        assert time.monotonic() < deadline, "the abandoned compiles were not stopped"
        time.sleep(0.1)
    m = metrics(server.base_url)
    assert m["tallyserve_structured_output_compile_cancelled_total"] >= 1
    assert m["tallyserve_structured_output_compile_queue_depth"] == 0
    assert _rss(pid) - rss_before < RSS_GROWTH_BOUND


def test_a_compile_past_its_deadline_is_a_400(server):
    schema = {"type": "string", "enum": [f"another slow value {i:06d}" for i in range(30_000)]}
    # (it compiles for minutes: a 400 naming the deadline at all is the deadline at work)
    r = httpx.post(server.base_url + "/v1/chat/completions", json=_body(schema), timeout=60)
    assert r.status_code == 400, r.text
    assert f"did not compile within {COMPILE_TIMEOUT_S:g} s" in r.json()["error"]["message"]
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_sigterm_during_a_long_compile_ends_the_process(server):
    """Last in the module: it stops the server."""
    answers: list = []

    def waiter() -> None:
        try:
            answers.append(httpx.post(server.base_url + "/v1/chat/completions",
                                      json=_body({**HUGE, "title": "sigterm"}), timeout=60).status_code)
        except httpx.HTTPError as exc:
            answers.append(type(exc).__name__)

    t = threading.Thread(target=waiter)
    t.start()
    assert _until_compiling(server.base_url, t.is_alive), "the long compile never started"
    t0 = time.monotonic()
    server.terminate()
    code = server.wait(DRAIN_TIMEOUT_S + 5)
    assert code == 0, f"still running {time.monotonic() - t0:.1f} s after SIGTERM:\n{server.log_tail()}"
    t.join(10)
    assert answers and answers[0] != 200
