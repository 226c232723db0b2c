"""The proxy's routing: least loaded healthy instance per role, requests sharing a prompt prefix on
the same prefill instance unless it is much busier, /health 503 while a role has no healthy instance,
and the prefill leg always asks for one token with do_remote_decode."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tallyserve.server import proxy
from tallyserve.server.proxy import AFFINITY_SLACK, Router, _prefill_body, _prefix_key, build_proxy_app


def test_same_prefix_same_prefill_instance_unless_much_busier():
    r = Router([f"http://p{i}" for i in range(4)], ["http://d0"])
    body = {"prompt": "a long shared system prompt " * 20 + "question one"}
    other = {"prompt": "a long shared system prompt " * 20 + "question two"}
    first = r.pick("prefill", _prefix_key(body))
    assert r.pick("prefill", _prefix_key(other)) is first  # the prefix decides, not the tail
    spread = {r.pick("prefill", _prefix_key({"prompt": f"{i} different"})).url for i in range(40)}
    assert len(spread) > 1
    first.in_flight = AFFINITY_SLACK + 1  # much busier than the idle ones: load wins
    assert r.pick("prefill", _prefix_key(body)) is not first


def test_least_loaded_decode_and_unhealthy_skipped():
    r = Router(["http://p0"], ["http://d0", "http://d1"])
    r.decode[0].in_flight = 3
    assert r.pick("decode").url == "http://d1"
    r.decode[1].healthy = False
    assert r.pick("decode").url == "http://d0"
    r.decode[0].healthy = False
    assert r.pick("decode") is None and not r.healthy()


def test_prefill_leg_asks_for_one_token():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "n": 3, "logprobs": 2,
            "stream_options": {"include_usage": True}, "min_tokens": 4}
    out = _prefill_body(body)
    assert out["max_tokens"] == 1 and out["kv_transfer_params"] == {"do_remote_decode": True}
    assert not {"stream", "n", "logprobs", "stream_options", "min_tokens"} & set(out)
    chat = _prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1


def test_health_is_503_when_a_role_has_no_healthy_instance(monkeypatch):
    monkeypatch.setattr(proxy, "HEALTH_INTERVAL_S", 0.05)
    app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])  # nothing listens there
    with TestClient(app) as client:
        import time

        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["decode"][0]["healthy"] is False
        bad = client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_instance"


def test_router_needs_both_roles():
    with pytest.raises(ValueError):
        Router([], ["http://d0"])


def test_failed_kv_load_is_a_503_not_a_500():
    from tallyserve.engine.async_engine import StepFailedError
    from tallyserve.server.errors import APIError
    from tallyserve.server.serving import engine_errors

    with pytest.raises(APIError) as info:
        with engine_errors():
            raise StepFailedError("KVTransferError: loading the prompt's KV failed: timed out")
    assert info.value.status == 503 and info.value.code == "kv_transfer_failed"
    with pytest.raises(APIError) as info:
        with engine_errors():
            raise StepFailedError("RuntimeError: boom")
    assert info.value.status == 500
