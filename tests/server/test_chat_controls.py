"""vLLM's chat template controls on the shared live server: continue_final_message, chat_template,
chat_template_kwargs, chat echo, add_special_tokens, and truncate_prompt_tokens (chat and
completions). Greedy outputs are compared with completions on the same token ids."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PARTIAL = "The quick brown"
CONTINUE = [{"role": "user", "content": "Tell me about the fox."}, {"role": "assistant", "content": PARTIAL}]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def http(api_server):
    with httpx.Client(base_url=api_server.base_url, headers=AUTH, timeout=60) as c:
        yield c


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def _tokenize(http, **body) -> list[int]:
    return _ok(http.post("/tokenize", json={"model": MODEL, **body}))["tokens"]


def _detokenize(http, ids: list[int]) -> str:
    return _ok(http.post("/detokenize", json={"model": MODEL, "tokens": ids}))["prompt"]


def _chat(http, **body) -> dict:
    return _ok(http.post("/v1/chat/completions", json={**GREEDY, **body}))


def _complete_ids(http, ids: list[int], **body) -> dict:
    return _ok(http.post("/v1/completions", json={**GREEDY, "prompt": ids, **body}))


def _stream(http, path: str, body: dict) -> list[dict]:
    r = http.post(path, json={**GREEDY, **body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ----------------------------------------------------------------------------- continue_final_message


def test_continue_final_message_leaves_the_last_message_open(http):
    ids = _tokenize(http, messages=CONTINUE, add_generation_prompt=False, continue_final_message=True)
    text = _detokenize(http, ids)
    assert text.endswith("<|im_start|>assistant\n" + PARTIAL), text
    # add_generation_prompt defaults to false when continuing
    assert _tokenize(http, messages=CONTINUE, continue_final_message=True) == ids
    closed = _detokenize(http, _tokenize(http, messages=CONTINUE, add_generation_prompt=False))
    assert closed.endswith(PARTIAL + "<|im_end|>\n"), closed

    # the chat completion continues exactly that prompt
    body = _chat(http, messages=CONTINUE, add_generation_prompt=False, continue_final_message=True)
    assert body["usage"]["prompt_tokens"] == len(ids)
    ref = _complete_ids(http, ids)
    assert body["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    assert _chat(http, messages=CONTINUE, continue_final_message=True)["choices"] == body["choices"]


def test_continue_final_message_with_add_generation_prompt_is_a_400(http):
    both = {"messages": CONTINUE, "add_generation_prompt": True, "continue_final_message": True}
    _error(http.post("/v1/chat/completions", json={**GREEDY, **both}), "continue_final_message")
    _error(http.post("/v1/chat/completions", json={**GREEDY, **both, "stream": True}), "continue_final_message")
    _error(http.post("/tokenize", json={"model": MODEL, **both}), "continue_final_message")
    # also when chat_template_kwargs set the flags (they override the request's, as in vLLM)
    kw = {"messages": CONTINUE, "continue_final_message": True,
          "chat_template_kwargs": {"add_generation_prompt": True}}
    _error(http.post("/v1/chat/completions", json={**GREEDY, **kw}), "continue_final_message")


# ----------------------------------------------------------------------------- chat_template(_kwargs)


def test_custom_chat_template_changes_the_prompt(http):
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hello, world!"}]
    plain = _tokenize(http, prompt="Be brief. Hello, world!", add_special_tokens=False)
    assert _tokenize(http, messages=messages, chat_template=CONTENT_ONLY) == plain
    body = _chat(http, messages=messages, chat_template=CONTENT_ONLY)
    assert body["usage"]["prompt_tokens"] == len(plain)
    assert body["choices"][0]["message"]["content"] == _complete_ids(http, plain)["choices"][0]["text"]
    default = _chat(http, messages=messages)
    assert default["usage"]["prompt_tokens"] == len(_tokenize(http, messages=messages)) > len(plain)


def test_chat_template_kwargs_reach_the_template(http):
    template = ("{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                "{{ greeting | default('none') }}|" + CONTENT_ONLY)
    messages = [{"role": "user", "content": "Hi"}]
    assert _detokenize(http, _tokenize(http, messages=messages, chat_template=template)) == "none|Hi"
    kwargs = {"greeting": "Bonjour", "enable_thinking": False}
    ids = _tokenize(http, messages=messages, chat_template=template, chat_template_kwargs=kwargs)
    assert _detokenize(http, ids) == "<think></think>Bonjour|Hi"
    body = _chat(http, messages=messages, chat_template=template, chat_template_kwargs=kwargs)
    assert body["usage"]["prompt_tokens"] == len(ids)
    # the model's own template receives them too (the ChatML one ignores them)
    assert _chat(http, messages=messages, chat_template_kwargs={"enable_thinking": False})["usage"] == \
        _chat(http, messages=messages)["usage"]


def test_broken_chat_template_is_a_400_naming_it(http):
    messages = [{"role": "user", "content": "Hi"}]
    for template in ["{% for m in messages %}{{ m.content }}",  # syntax: no endfor
                     "{{ raise_exception('no way') }}",
                     "{{ 1 // 0 }}",
                     "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox refuses it
                     "{{ undefined_thing.attr }}"]:
        for path, extra in (("/v1/chat/completions", GREEDY), ("/v1/chat/completions", {**GREEDY, "stream": True}),
                            ("/tokenize", {"model": MODEL})):
            r = http.post(path, json={**extra, "messages": messages, "chat_template": template})
            err = _error(r, "chat_template")
            assert r.headers["content-type"].startswith("application/json")
            assert "subclasses" not in err["message"] or "class 'object'" not in err["message"]
    err = _error(http.post("/v1/chat/completions", json={**GREEDY, "messages": messages,
                                                         "chat_template_kwargs": {"tokenize": True}}),
                 "chat_template_kwargs")
    assert "tokenize" in err["message"]
    r = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages, "chat_template_kwargs": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


# ----------------------------------------------------------------------------- echo


def test_chat_echo_prepends_the_continued_assistant_message(http):
    body = {"messages": CONTINUE, "continue_final_message": True}
    plain = _chat(http, **body)["choices"][0]["message"]["content"]
    echoed = _chat(http, **body, echo=True)
    assert echoed["choices"][0]["message"]["content"] == PARTIAL + plain
    assert _chat(http, **body, echo=False)["choices"][0]["message"]["content"] == plain
    # the last message is not the assistant's: nothing to echo
    user_last = [{"role": "user", "content": "Hi"}]
    assert _chat(http, messages=user_last, echo=True)["choices"] == _chat(http, messages=user_last)["choices"]

    # streaming: the first chunk of each choice carries the echo, the rest is the continuation
    for echo in (True, False):
        chunks = _stream(http, "/v1/chat/completions", {**body, "echo": echo, "n": 2})
        firsts = {}
        content = {0: "", 1: ""}
        for c in chunks:
            for ch in c["choices"]:
                firsts.setdefault(ch["index"], ch["delta"])
                content[ch["index"]] += ch["delta"].get("content", "")
        assert firsts[0] == {"role": "assistant", "content": PARTIAL if echo else ""}, firsts
        assert content[0] == content[1] == (PARTIAL if echo else "") + plain
        assert chunks[-1]["usage"]["prompt_tokens"] == echoed["usage"]["prompt_tokens"]


def test_chat_add_special_tokens(http):
    messages = [{"role": "user", "content": "Hi"}]
    # the test tokenizer adds no BOS: the same prompt either way, and the field is accepted
    assert _chat(http, messages=messages, add_special_tokens=True)["usage"] == _chat(http, messages=messages)["usage"]
    assert _tokenize(http, messages=messages, add_special_tokens=True) == _tokenize(http, messages=messages)


# ----------------------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    ids = _tokenize(http, prompt="The quick brown fox jumps over the lazy dog. Hello, world!")
    assert len(ids) > 8
    ref = _complete_ids(http, ids[-5:])
    body = _complete_ids(http, ids, truncate_prompt_tokens=5)
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["text"] == ref["choices"][0]["text"]
    text = _ok(http.post("/v1/completions", json={**GREEDY, "prompt": _detokenize(http, ids),
                                                   "truncate_prompt_tokens": 5}))
    assert text["usage"]["prompt_tokens"] == 5 and text["choices"] == body["choices"]
    # a prompt already shorter than N, and -1 (max_model_len), are untouched
    for n in (len(ids) + 3, -1):
        assert _complete_ids(http, ids, truncate_prompt_tokens=n)["usage"]["prompt_tokens"] == len(ids)
    chunks = _stream(http, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 5})
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == ref["choices"][0]["text"]


def test_truncate_prompt_tokens_in_chat(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    ids = _tokenize(http, messages=messages)
    body = _chat(http, messages=messages, truncate_prompt_tokens=4)
    assert body["usage"]["prompt_tokens"] == 4
    assert body["choices"][0]["message"]["content"] == _complete_ids(http, ids[-4:])["choices"][0]["text"]
    chunks = _stream(http, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 4})
    assert chunks[-1]["usage"]["prompt_tokens"] == 4


def test_bad_truncate_prompt_tokens_is_a_400(http):
    max_len = _ok(http.get("/v1/models"))["data"][0]["max_model_len"]
    for value in (0, -2, max_len + 1):
        _error(http.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7], "truncate_prompt_tokens": value}),
               "truncate_prompt_tokens")
        _error(http.post("/v1/chat/completions", json={**GREEDY, "messages": [{"role": "user", "content": "Hi"}],
                                                       "truncate_prompt_tokens": value}), "truncate_prompt_tokens")
    r = http.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7], "truncate_prompt_tokens": "3"})
    assert r.status_code == 400, r.text


def test_request_chat_template_needs_the_servers_trust():
    """Without --trust-request-chat-template a request's own template is a 400 naming it (the sandbox
    stops escapes, not a template that loops for minutes on the one tokenizer thread)."""
    from types import SimpleNamespace

    from tallyserve.server.errors import APIError
    from tallyserve.server.serving_chat import chat_controls

    req = SimpleNamespace(chat_template="{{ 'x' }}", chat_template_kwargs=None, continue_final_message=False,
                          add_generation_prompt=True, model_fields_set=set())
    with pytest.raises(APIError) as err:
        chat_controls(req, SimpleNamespace(trust_request_chat_template=False))
    assert err.value.status == 400 and err.value.param == "chat_template"
    assert chat_controls(req, SimpleNamespace(trust_request_chat_template=True))["chat_template"] == "{{ 'x' }}"
    assert chat_controls(SimpleNamespace(**{**vars(req), "chat_template": None}),
                         SimpleNamespace(trust_request_chat_template=False))["chat_template"] is None
