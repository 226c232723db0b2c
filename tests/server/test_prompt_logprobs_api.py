"""Prompt logprobs over the API, with the official openai client, on the bundled SmolLM2 model:
completions echo + logprobs (+ max_tokens 0, what lm-evaluation-harness sends for loglikelihood)
returns the prompt's tokens and logprobs equal to transformers' on the same GGUF weights; vLLM's
prompt_logprobs field on completions and chat; streaming; 400s for bad values; no KV block leaks."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.bundled_reference import prompt_logprobs
from tests.server.live_server import API_KEY, metrics, wait_idle

ATOL = 1e-4
MODEL = "smol"
TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time,"


@pytest.fixture(scope="module")
def client(bundled_server):
    c = openai.OpenAI(base_url=bundled_server.base_url + "/v1", api_key=API_KEY, timeout=120.0, max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(bundled_dir):
    return AutoTokenizer.from_pretrained(bundled_dir)


@pytest.fixture(scope="module")
def reference(bundled_hf):
    cache = {}

    def ref(ids):
        if tuple(ids) not in cache:
            cache[tuple(ids)] = prompt_logprobs(bundled_hf, list(ids))
        return cache[tuple(ids)]

    return ref


def check_echoed_prompt(lp, ids, tokenizer, ref, k):
    """The legacy logprobs of an echoed prompt: its tokens, null then each token's logprob, null then
    its top-k (plus the token), offsets from 0 over the token texts; all equal to ``ref``."""
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for i in range(1, n):
        row = ref[i - 1]
        assert abs(lp.token_logprobs[i] - row[ids[i]].item()) <= ATOL, i
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and abs(top[lp.tokens[i]] - lp.token_logprobs[i]) < 1e-9
        assert k <= len(top) <= k + 1
        assert abs(max(top.values()) - row.max().item()) <= ATOL  # the most likely token is there
        for value in top.values():
            assert any(abs(value - v) <= ATOL for v in row.topk(k).values.tolist()) or \
                abs(value - lp.token_logprobs[i]) < 1e-9


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(client, tokenizer, reference):
    ids = tokenizer(TEXT)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    (choice,) = r.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)  # the prompt alone
    check_echoed_prompt(choice.logprobs, ids, tokenizer, reference(ids), 2)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)


def test_token_id_prompts_as_lm_eval_sends_them(client, tokenizer, reference):
    """Several token-id prompts in one request (lm-eval's batches), max_tokens 1 and 0."""
    prompts = [tokenizer(t)["input_ids"] for t in ("Paris is the capital of", "One, two, three, four")]
    for max_tokens in (0, 1):
        r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0)
        assert [c.index for c in r.choices] == [0, 1]
        for ids, choice in zip(prompts, r.choices):
            assert len(choice.logprobs.tokens) == len(ids) + max_tokens
            check_echoed_prompt(choice.logprobs, ids, tokenizer, reference(ids), 1)
            if max_tokens:  # the generated token: greedy, so the argmax after the prompt
                assert abs(choice.logprobs.token_logprobs[-1] - reference(ids)[-1].max().item()) <= ATOL


def test_echo_logprobs_then_generated_tokens(client, tokenizer, reference):
    ids = tokenizer(TEXT)["input_ids"]
    plain = client.completions.create(model=MODEL, prompt=TEXT, logprobs=2, max_tokens=4, temperature=0)
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    lp, gen = r.choices[0].logprobs, plain.choices[0].logprobs
    assert r.choices[0].text == TEXT + plain.choices[0].text
    check_echoed_prompt(lp, ids, tokenizer, reference(ids), 2)
    # same tokens; logprobs equal up to float32 summation order (a cached prefix is read by another kernel)
    assert lp.tokens[len(ids):] == gen.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(gen.token_logprobs, abs=1e-5)
    offsets = lp.text_offset
    assert offsets == sorted(offsets) and offsets[len(ids)] == offsets[len(ids) - 1] + len(lp.tokens[len(ids) - 1])


def test_streamed_echo_carries_the_prompt_first(client, tokenizer, reference):
    ids = tokenizer(TEXT)["input_ids"]
    whole = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(TEXT) and len(first.logprobs.tokens) > len(ids)
    check_echoed_prompt(first.logprobs, ids, tokenizer, reference(ids), 1)
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    offsets = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset
    assert "".join(ch.text for c in chunks for ch in c.choices) == whole.choices[0].text
    # max_tokens 0: one chunk, the prompt alone
    only = [c for c in client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0,
                                                 stream=True) if c.choices]
    assert len(only) == 1 and only[0].choices[0].text == TEXT and only[0].choices[0].finish_reason == "length"
    assert len(only[0].choices[0].logprobs.tokens) == len(ids)


def _check_vllm_field(field, ids, ref, k):
    """vLLM's prompt_logprobs: null first, then token id -> {logprob, rank, decoded_token}."""
    assert len(field) == len(ids) and field[0] is None
    for i in range(1, len(ids)):
        entry = {int(t): v for t, v in field[i].items()}
        row, own = ref[i - 1], entry[ids[i]]
        assert abs(own["logprob"] - row[ids[i]].item()) <= ATOL
        assert own["rank"] == int((row > row[ids[i]]).sum()) + 1 or abs(own["logprob"] - row.max().item()) <= ATOL
        assert isinstance(own["decoded_token"], str)
        ranked = sorted((v["rank"], v["logprob"]) for t, v in entry.items() if v["rank"] <= k)
        assert [rk for rk, _ in ranked][:k] == list(range(1, k + 1))
        assert len(entry) <= k + 1


def test_prompt_logprobs_on_completions_and_chat(client, tokenizer, reference):
    ids = tokenizer(TEXT)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    _check_vllm_field(r.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 3)
    assert r.choices[0].logprobs is None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert c.usage.prompt_tokens == len(chat_ids)
    field = c.model_extra["prompt_logprobs"]
    _check_vllm_field(field, chat_ids, reference(chat_ids), 0)
    assert all(len(e) == 1 for e in field[1:])  # 0: the prompt token alone
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.model_extra.get("prompt_logprobs") is None
    assert plain.choices[0].message.content == c.choices[0].message.content


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 31}, "prompt_logprobs"),  # the server runs with --max-logprobs 30
    ("completions", {"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ("completions", {"echo": True, "logprobs": 31, "max_tokens": 0}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 31}, "top_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 1, "use_beam_search": True, "n": 2}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 31}, "prompt_logprobs"),
])
def test_bad_values_are_400s_naming_the_field(bundled_server, endpoint, body, param):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": TEXT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(f"{bundled_server.base_url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                   json={**base, **body}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param in err["message"] or param == "max_tokens" and "echo" in err["message"]


def test_no_kv_block_leaks_and_the_ledger_held(bundled_server, client):
    # a non-finite logprob still makes valid JSON: the body parses with a strict parser
    r = httpx.post(f"{bundled_server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 5, "max_tokens": 0}, timeout=60)
    json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the body"))
    m = wait_idle(bundled_server.base_url)
    assert m["tallyserve_kv_blocks_free"] == m["tallyserve_kv_blocks_total"]
    assert m["tallyserve_ledger_violations_total"] == 0 and m["tallyserve_step_errors_total"] == 0
    assert metrics(bundled_server.base_url)["tallyserve_engine_healthy"] == 1


def test_max_logprobs_flag_lifts_the_limit_of_20(client, tokenizer, reference):
    """--max-logprobs 30: 30 top logprobs for the echoed prompt, the prompt_logprobs field and chat."""
    ids = tokenizer(TEXT)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=30, max_tokens=0,
                                  extra_body={"prompt_logprobs": 25})
    check_echoed_prompt(r.choices[0].logprobs, ids, tokenizer, reference(ids), 30)
    _check_vllm_field(r.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 25)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, logprobs=True, top_logprobs=30)
    assert all(len(e.top_logprobs) == 30 for e in c.choices[0].logprobs.content)
