"""Every request field of OpenAI's and vLLM's completions and chat completions APIs is either
honoured or rejected: the walk over the catalogue (tallyserve/server/fields.py). An unsupported
field with a value that asks for something is a 400 naming it (code "unsupported_parameter"); the
same field absent, null or with a harmless value is accepted; an honoured field with a valid value
is a 200; a field neither API defines is ignored and logged."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tallyserve.server import fields
from tallyserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = {
    fields.COMPLETIONS: ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}),
    fields.CHAT: ("/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                   "temperature": 0}),
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}

# A value of each unsupported field that asks for something tallyserve does not do.
UNSUPPORTED_SAMPLES = {
    "spaces_between_special_tokens": False,
    "guided_whitespace_pattern": " *",
    "priority": 1,
    "request_id": "my-id",
    "logits_processors": ["mod.Proc"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "cache_salt": "salt-0123456789",
    "vllm_xargs": {"k": 1},
    "mm_processor_kwargs": {"k": 1},
    "media_io_kwargs": {"image": {}},
    "suffix": " end",
    "prompt_embeds": "AAAA",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "parallel_tool_calls": "yes",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "service_tier": "flex",
    "store": True,
    "web_search_options": {},
    "prompt_cache_key": 7,
    "safety_identifier": ["x"],
    "documents": [{"title": "t", "text": "x"}],
    "include_reasoning": False,
}

# Harmless values of unsupported fields (besides null), for the predicates.
PREDICATE_SAMPLES = {
    fields.ANY_STRING: ["abc"],
    fields.ANY_BOOL: [True, False],
    fields.TEXT_FORMAT: [{"type": "text"}, {}],
}

# A valid value of each honoured field (merged into the base request).
HONOURED_SAMPLES = {
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": False}},  # nothing to transfer: accepted anywhere
    "model": {"model": MODEL},
    "prompt": {"prompt": [1, 2, 3]},
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 2.0}},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "n": {"n": 2},
    "seed": {"seed": 7, "temperature": 1.0},
    "stop": {"stop": ["\n"]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9, "temperature": 1.0},
    "user": {"user": "u-1"},
    "metadata": {"metadata": {"k": "v"}},
    "best_of": {"best_of": 1},
    "use_beam_search": {"use_beam_search": True, "n": 2},
    "top_k": {"top_k": 5, "temperature": 1.0},
    "min_p": {"min_p": 0.1, "temperature": 1.0},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [2]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1},
    "skip_special_tokens": {"skip_special_tokens": False},
    "allowed_token_ids": {"allowed_token_ids": [3, 9, 100]},
    "bad_words": {"bad_words": ["hello"]},
    "echo": {"echo": True},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "logprobs": {fields.COMPLETIONS: {"logprobs": 2}, fields.CHAT: {"logprobs": True}},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "add_generation_prompt": {"add_generation_prompt": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4},
    "add_special_tokens": {fields.COMPLETIONS: {"add_special_tokens": False},
                           fields.CHAT: {"add_special_tokens": True}},
    "continue_final_message": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                               "add_generation_prompt": False, "continue_final_message": True},
    "chat_template": {"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              "tool_choice": "none"},
    "tool_choice": {"tool_choice": "none"},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "guided_json": {"guided_json": SCHEMA},
    "guided_regex": {"guided_regex": "[a-z]+"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "guided_grammar": {"guided_grammar": "root ::= \"a\""},
    "guided_decoding_backend": {"guided_decoding_backend": "xgrammar"},
    "structural_tag": {"structural_tag": json.dumps({"type": "structural_tag",
                                                     "format": {"type": "const_string", "value": "hi"}})},
    "structured_outputs": {"structured_outputs": {"json": SCHEMA}},
    "response_format": {"response_format": {"type": "json_object"}},
}


def _catalogue_walk():
    for endpoint, catalogue in fields.CATALOGUES.items():
        for name, info in catalogue.items():
            yield endpoint, name, info


def test_catalogue_covers_the_request_models():
    """Every declared request field is catalogued; every honoured field is declared (so parsed);
    every catalogued field has a sample here."""
    for endpoint, model in ((fields.COMPLETIONS, CompletionRequest), (fields.CHAT, ChatCompletionRequest)):
        catalogue = fields.CATALOGUES[endpoint]
        assert set(model.model_fields) <= set(catalogue), set(model.model_fields) - set(catalogue)
        honoured = {n for n, i in catalogue.items() if i.status == fields.HONOURED}
        assert honoured <= set(model.model_fields), honoured - set(model.model_fields)
        for name, info in catalogue.items():
            assert info.status in (fields.HONOURED, fields.UNSUPPORTED) and info.reason
            samples = HONOURED_SAMPLES if info.status == fields.HONOURED else UNSUPPORTED_SAMPLES
            assert name in samples, (endpoint, name)
    # the fields the issue names, and OpenAI's, are all there
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                 "prompt_logprobs", "truncate_prompt_tokens", "return_tokens_as_token_ids", "response_format"):
        assert name in fields.COMPLETION_FIELDS and name in fields.CHAT_FIELDS
    for name in ("continue_final_message", "chat_template", "chat_template_kwargs", "echo", "tools", "audio",
                 "modalities", "prediction", "reasoning_effort", "service_tier", "store", "metadata",
                 "parallel_tool_calls", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier"):
        assert name in fields.CHAT_FIELDS
    for name in ("best_of", "echo", "suffix", "user", "logprobs"):
        assert fields.COMPLETION_FIELDS[name]


@pytest.fixture(scope="module")
def http(api_server):
    with httpx.Client(base_url=api_server.base_url, headers=AUTH, timeout=60) as c:
        yield c


def _post(http: httpx.Client, endpoint: str, extra: dict) -> httpx.Response:
    path, base = BASE[endpoint]
    return http.post(path, json={**base, **extra})


def _assert_ok(r: httpx.Response, what) -> None:
    assert r.status_code == 200, (what, r.text)
    if r.headers["content-type"].startswith("text/event-stream"):
        assert "data: [DONE]" in r.text and '"error"' not in r.text, (what, r.text[-500:])


def _harmless_values(info: fields.FieldInfo) -> list:
    values = [None]
    for h in info.harmless:
        values += PREDICATE_SAMPLES[h] if callable(h) else [h]
    return values


def test_unsupported_fields_with_a_value_are_rejected_by_name(http):
    checked = 0
    for endpoint, name, info in _catalogue_walk():
        if info.status != fields.UNSUPPORTED:
            continue
        value = UNSUPPORTED_SAMPLES[name]
        assert not info.accepts(value), (endpoint, name, value)
        r = _post(http, endpoint, {name: value})
        assert r.status_code == 400, (endpoint, name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and err["code"] == "unsupported_parameter", (endpoint, name, err)
        assert name in err["message"] and "not supported by tallyserve" in err["message"], err
        checked += 1
    # (per endpoint) 39 before metadata was honoured, 70 before the chat controls were honoured, 62 before structured
    # outputs, 46 before tools, 43 before prompt_logprobs, 41 before kv_transfer_params
    assert checked >= 38


def test_harmless_values_of_unsupported_fields_are_accepted(http):
    for endpoint, name, info in _catalogue_walk():
        if info.status != fields.UNSUPPORTED:
            continue
        for value in _harmless_values(info):
            _assert_ok(_post(http, endpoint, {name: value}), (endpoint, name, value))


def test_honoured_fields_are_accepted(http):
    for endpoint, name, info in _catalogue_walk():
        if info.status != fields.HONOURED:
            continue
        sample = HONOURED_SAMPLES[name]
        sample = sample.get(endpoint, sample) if endpoint in sample else sample
        _assert_ok(_post(http, endpoint, sample), (endpoint, name, sample))


def test_existing_rules_of_honoured_fields_still_apply(http):
    for endpoint, extra, param in [
        (fields.COMPLETIONS, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (fields.CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (fields.COMPLETIONS, {"prompt_logprobs": 21}, "prompt_logprobs"),  # above max_logprobs
        (fields.COMPLETIONS, {"best_of": 3, "n": 2}, "best_of"),
        (fields.CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (fields.CHAT, {"use_beam_search": True, "stream": True}, "stream"),
    ]:
        r = _post(http, endpoint, extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_continuous_usage_stats_is_rejected(http):
    for endpoint in fields.CATALOGUES:
        r = _post(http, endpoint, {"stream": True, "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stream_options.continuous_usage_stats" and err["code"] == "unsupported_parameter"


def test_json_types_of_harmless_values_are_strict(http):
    for endpoint, extra, param in [(fields.CHAT, {"priority": False}, "priority"),
                                   (fields.COMPLETIONS, {"priority": 0.0}, "priority"),
                                   (fields.CHAT, {"store": 0}, "store"),
                                   (fields.CHAT, {"response_format": {"type": "text", "json_schema": SCHEMA}},
                                    "response_format")]:
        r = _post(http, endpoint, extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_unknown_fields_are_ignored_and_logged_once(api_server, http):
    name = f"x_future_openai_field_{int(time.time() * 1000)}"
    for endpoint in fields.CATALOGUES:
        for _ in range(2):
            _assert_ok(_post(http, endpoint, {name: {"anything": [1, 2]}}), name)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [ln for ln in api_server.log_path.read_text(errors="replace").splitlines() if name in ln]
        if lines:
            break
        time.sleep(0.1)
    assert len(lines) == 1, (lines, api_server.log_tail())
    assert "not an OpenAI or vLLM parameter" in lines[0]


def test_unsupported_field_in_a_streamed_request_is_a_400_before_the_stream(http):
    for endpoint in fields.CATALOGUES:
        for extra, param in (({"logits_processors": ["mod.Proc"]}, "logits_processors"),
                             ({"guided_regex": "a("}, "guided_regex")):  # honoured, but does not compile
            r = _post(http, endpoint, {"stream": True, **extra})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
            assert json.loads(r.text)["error"]["param"] == param
