"""A live `tallyserve serve` on a tiny random Llama, driven by the official `openai` client.

Greedy outputs are checked against the offline engine on the same weights, streamed text against
non-streamed text, and usage against the tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest

from tallyserve import LLM, SamplingParams
from tests.server.live_server import API_KEY, MODEL, metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world!", "Once upon a time", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def _greedy(offline: LLM, prompt, max_tokens: int = 16):
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0]


def test_models_and_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    r = httpx.get(server.base_url + "/version", timeout=5)
    assert r.status_code == 200 and r.json()["version"]


def test_completion_matches_offline_engine(client, offline):
    tok = offline.get_tokenizer()
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        ref = _greedy(offline, prompt)
        choice = resp.choices[0]
        assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
        assert resp.usage.prompt_tokens == len(tok.encode(prompt))
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_default_max_tokens_is_16(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_min_tokens_holds_back_stop_token_ids(client, offline):
    ref = _greedy(offline, PROMPTS[2], 8)
    stop = ref.token_ids[0]
    early = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 4})
    assert held.usage.completion_tokens >= 4 and held.choices[0].finish_reason in ("stop", "length")


def test_token_id_prompts_and_batches(client, offline):
    tok = offline.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice, p in zip(resp.choices, PROMPTS[:2]):
        assert choice.text == _greedy(offline, p, 8).text
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    single = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0)
    assert single.choices[0].text == resp.choices[0].text


def test_n_greater_than_one(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=3, max_tokens=6, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == list(range(6))
    assert resp.usage.completion_tokens == 6 * 6
    texts = [c.text for c in resp.choices]
    assert len(set(texts[:3])) > 1  # independent samples (seeds 7, 8, 9)


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert a == b
    assert a != c


def test_stop_string(client, offline):
    full = _greedy(offline, PROMPTS[0], 24).text
    stop = next(ch for ch in full[2:] if ch.isascii() and ch.isalnum())
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert abs(max(top.values()) - value) < 1e-4  # greedy: the chosen token is the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPTS[3] + _greedy(offline, PROMPTS[3], 5).text


def test_chat_matches_offline_engine(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref = offline.chat(messages, SamplingParams(max_tokens=12, temperature=0.0))[0]
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    alias = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert alias.choices[0].message.content == choice.message.content


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
        assert entry.bytes == list(entry.token.encode())


def test_streamed_completion_equals_non_streamed(client):
    for prompt in PROMPTS[:2]:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        whole = client.completions.create(**kwargs)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [whole.choices[0].finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
        assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_streamed_chat_n2_with_seed_equals_non_streamed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0.8,
                  seed=11, n=2)
    whole = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_raw_sse_framing(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[6:])["object"] == "text_completion"


def test_metrics_parse_and_move(server, client):
    before = wait_idle(server.base_url)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server.base_url)
    assert after['tallyserve_requests_total{finish_reason=length}'] == before['tallyserve_requests_total{finish_reason=length}'] + 1
    assert after["tallyserve_generation_tokens_total"] == before["tallyserve_generation_tokens_total"] + 5
    assert after["tallyserve_engine_steps_total"] >= before["tallyserve_engine_steps_total"] + 5
    assert after["tallyserve_tokens_per_step_count"] > before["tallyserve_tokens_per_step_count"]
    assert after["tallyserve_time_to_first_token_seconds_count"] == before["tallyserve_time_to_first_token_seconds_count"] + 1
    assert after["tallyserve_e2e_request_latency_seconds_count"] == before["tallyserve_e2e_request_latency_seconds_count"] + 1
    assert after["tallyserve_scheduled_tokens_total"] == after["tallyserve_forward_tokens_total"]
    assert after["tallyserve_ledger_violations_total"] == 0
    assert after["tallyserve_kv_blocks_free"] == after["tallyserve_kv_blocks_total"] == 256
    assert metrics(server.base_url)["tallyserve_engine_healthy"] == 1


def test_streamed_logprobs_equal_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, values = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == whole.tokens and values == pytest.approx(whole.token_logprobs, abs=1e-5)

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    whole_chat = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **chat)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole_chat] and len(streamed) == 8


METADATA = {"run": "nightly-7", "team": "search"}


def test_metadata_is_accepted_and_echoed_in_the_response_object(server, client):
    """OpenAI's `metadata` (nothing is stored): the chat completion and completion objects echo
    it; without it the objects carry no `metadata` key; stream chunks do not carry it."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, metadata=METADATA)
    assert chat.to_dict()["metadata"] == METADATA
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                           extra_body={"metadata": METADATA})
    assert completion.to_dict()["metadata"] == METADATA
    widest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # OpenAI's limits, exactly
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": PROMPTS[0]})):
        base = {"model": MODEL, "max_tokens": 2, "temperature": 0, **body}
        plain = httpx.post(server.base_url + path, headers=AUTH, timeout=30, json=base)
        assert plain.status_code == 200 and "metadata" not in plain.json()
        for metadata in (widest, {}, None):
            r = httpx.post(server.base_url + path, headers=AUTH, timeout=30, json={**base, "metadata": metadata})
            assert r.status_code == 200 and r.json().get("metadata") == metadata, (path, r.text[:300])
        with httpx.stream("POST", server.base_url + path, headers=AUTH, timeout=30,
                          json={**base, "metadata": METADATA, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events and all("metadata" not in e for e in events)


@pytest.mark.parametrize("metadata,match", [
    (["run", "nightly"], "object"),
    ("nightly", "object"),
    ({"run": 7}, "values must be strings"),
    ({"run": None}, "values must be strings"),
    ({"run": {"nested": "x"}}, "values must be strings"),
    ({f"k{i}": "v" for i in range(17)}, "at most 16 keys"),
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"run": "v" * 513}, "at most 512 characters"),
])
def test_metadata_of_the_wrong_shape_is_a_400_naming_it(server, metadata, match):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"prompt": PROMPTS[0]}), ("/v1/responses", {"input": "Hi"})):
        r = httpx.post(server.base_url + path, headers=AUTH, timeout=30,
                       json={"model": MODEL, "metadata": metadata, **body})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "metadata" and match in err["message"], (path, err)


def test_the_responses_api_echoes_metadata_as_before(server):
    r = httpx.post(server.base_url + "/v1/responses", headers=AUTH, timeout=30,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "metadata": METADATA})
    assert r.status_code == 200 and r.json()["metadata"] == METADATA
    r = httpx.post(server.base_url + "/v1/responses", headers=AUTH, timeout=30,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["metadata"] == {}
