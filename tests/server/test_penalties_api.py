"""Penalties and token controls over the OpenAI API: the same tokens as the offline engine, and
out-of-range values are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest

from tallyserve import SamplingParams
from tests.server.live_server import API_KEY, MODEL

PROMPT = [12, 200, 31, 9, 77, 140, 66, 21]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _offline(offline, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, **kw)
    return offline.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids


def _served(client, **kw):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.0, logprobs=0,
                                  extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)
    return r.choices[0]


@pytest.mark.parametrize("kw,offline_kw", [
    (dict(presence_penalty=1.5), dict(presence_penalty=1.5)),
    (dict(frequency_penalty=1.2, presence_penalty=-0.4), dict(frequency_penalty=1.2, presence_penalty=-0.4)),
    (dict(extra_body={"repetition_penalty": 1.8}), dict(repetition_penalty=1.8)),
    (dict(logit_bias={"77": 100}), dict(logit_bias={77: 100.0})),
    (dict(extra_body={"allowed_token_ids": [3, 9, 100]}), dict(allowed_token_ids=[3, 9, 100])),
])
def test_same_tokens_as_offline(client, offline, kw, offline_kw):
    want = _offline(offline, **offline_kw)
    got = _served(client, **kw)
    assert got.text == offline.engine.tokenizer.decode(want)
    if "allowed_token_ids" in offline_kw:
        assert set(want) <= set(offline_kw["allowed_token_ids"])
    if "logit_bias" in offline_kw:
        assert want == [77] * 10


def test_bad_words_over_the_api(client, offline):
    tok = offline.engine.tokenizer
    plain = _offline(offline)
    word = next(w for w in (tok.decode([t]) for t in plain)
                if w.strip() and len(tok.encode(w, add_special_tokens=False)) == 1)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            bad_words=[word]).with_bad_words_tokenized(tok)
    want = offline.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    assert want != plain
    for seq in params.bad_words_token_ids:
        if len(seq) == 1:
            assert seq[0] not in want
    got = _served(client, extra_body={"bad_words": [word]})
    assert got.text == tok.decode(want)


def test_chat_accepts_penalties(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": 2},
                                       extra_body={"repetition_penalty": 1.2})
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("logit_bias", {"5": 101}), ("logit_bias", {"-3": 1}),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"999999": 1}), ("allowed_token_ids", [999999]),
    ("allowed_token_ids", [-1]), ("allowed_token_ids", []), ("bad_words", [""]),
])
def test_bad_values_are_400_naming_the_field(api_server, field, value):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, field: value}
    r = httpx.post(api_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_penalties_with_beam_search_are_400(api_server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "use_beam_search": True, "n": 2,
            "presence_penalty": 1.0}
    r = httpx.post(api_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty", r.text
