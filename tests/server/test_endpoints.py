"""/tokenize, /detokenize (vLLM's shapes), /v1/models/{id}, /ping and HEAD /health on the shared
live server; model ids with slashes on an in-process app."""

from __future__ import annotations

import types

import httpx
import openai
import pytest

from tests.server.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["The quick brown fox", "Hello, world!", "Café, naïve, 東京 🙂 <|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


def _max_model_len(server) -> int:
    return httpx.get(server.base_url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["max_model_len"]


def test_tokenize_detokenize_round_trip(server, offline):
    tok = offline.get_tokenizer()
    max_len = _max_model_len(server)
    for text in TEXTS:
        r = _post(server, "/tokenize", {"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["token_strs"] is None
        assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == max_len
        back = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}
    big = "The quick brown fox jumps over the lazy dog. 東京 🙂 " * 400  # over INLINE_TOKENIZE_CHARS: the thread
    ids = _post(server, "/tokenize", {"prompt": big}).json()["tokens"]  # model is optional
    assert ids == tok.encode(big) and len(ids) > 4000
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == big
    strs = _post(server, "/tokenize", {"prompt": TEXTS[0], "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(isinstance(s, str) and s for s in strs["token_strs"])


def test_tokenize_chat_matches_chat_completion_usage(server, client):
    usage = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0).usage
    body = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert body["count"] == len(body["tokens"]) == usage.prompt_tokens
    plain = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": False}).json()
    assert plain["tokens"] == body["tokens"][:plain["count"]] and plain["count"] < body["count"]
    text = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"model": MODEL, "tokens": [5, -1]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [1 << 70]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": ["5"]}, "tokens"),
    ("/detokenize", {"model": MODEL}, "tokens"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
    assert err["param"].split(".")[0] == param, err


def test_out_of_vocabulary_ids_are_400(server, offline):
    vocab = offline.get_tokenizer().vocab_size
    assert _post(server, "/detokenize", {"tokens": [vocab - 1]}).status_code == 200
    r = _post(server, "/detokenize", {"tokens": [0, vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and str(vocab) in r.json()["error"]["message"]


def test_invalid_unicode_is_400(server):
    raw = b'{"model": "%s", "prompt": "bad \\ud800 text"}' % MODEL.encode()
    r = httpx.post(server.base_url + "/tokenize", content=raw, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_wrong_model_is_404(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": MESSAGES}),
                       ("/detokenize", {"tokens": [1]})):
        r = _post(server, path, {**body, "model": "no-such-model"})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", (path, r.text)


def test_retrieve_model(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "tallyserve"
    assert card.model_extra["max_model_len"] == _max_model_len(server)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    for path in ("/v1/models/org/model", "/v1/models/org%2Fmodel"):  # slashes reach the handler whole
        r = httpx.get(server.base_url + path, headers=AUTH, timeout=10)
        assert r.status_code == 404 and "'org/model'" in r.json()["error"]["message"], (path, r.text)


def test_ping_and_head_health(server):
    health = httpx.get(server.base_url + "/health", timeout=10)
    for method in ("GET", "POST"):  # vLLM's /ping: the same answer as /health, no key needed
        r = httpx.request(method, server.base_url + "/ping", timeout=10)
        assert r.status_code == health.status_code == 200 and r.json()["status"] == "ok"
        assert set(r.json()) == set(health.json())
    head = httpx.head(server.base_url + "/health", timeout=10)
    assert head.status_code == 200 and head.content == b""


def test_tokenizer_routes_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = _post(server, path, body, headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
    assert httpx.get(server.base_url + "/v1/models/" + MODEL, timeout=10).status_code == 401


def test_openapi_documents_the_new_routes(server):
    paths = httpx.get(server.base_url + "/openapi.json", headers=AUTH, timeout=10).json()["paths"]
    for path in ("/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "500"}, path
        for status in ("400", "401", "404", "413", "500"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(paths["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404", "500"}
    assert set(paths["/ping"]) == {"get", "post"} and "503" in paths["/ping"]["get"]["responses"]
    assert "503" in paths["/health"]["head"]["responses"]


def test_model_ids_with_slashes():
    """An in-process app serving "org/model" (no engine loop: the lifespan does not run)."""
    from starlette.testclient import TestClient

    from tallyserve.server.app import build_app

    engine = types.SimpleNamespace(served_model_name="org/model", max_model_len=64, tokenizer=None)
    client = TestClient(build_app(engine))
    for path in ("/v1/models/org/model", "/v1/models/org%2Fmodel"):
        r = client.get(path)
        assert r.status_code == 200 and r.json()["id"] == "org/model" and r.json()["max_model_len"] == 64, path
    assert client.get("/v1/models/org").status_code == 404
    assert client.get("/v1/models/org/model/x").status_code == 404
