"""Tokenizer loading (directories, GGUF) and chat templates (tallyserve/tokenizer.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from tests.tiny_tokenizer import (  # noqa: E402
    CHATML_TEMPLATE, NEEDS_BUNDLED_GGUF, bundled_gguf_tokenizer, make_tiny_tokenizer,
)

from tallyserve.tokenizer import load_tokenizer  # noqa: E402

VOCAB = 256
MULTI_BYTE = "é ñ ü 東京 你好 こんにちは 🙂 🚀 👍🏽 𝄞 résumé naïve"


# ---- loading ------------------------------------------------------------------------------


def test_load_tiny_tokenizer(tok, tok_dir):
    assert tok.vocab_size == VOCAB
    assert tok.eos_token_id == 0 and tok.bos_token_id is None
    assert {0, 1, 2} <= set(tok.all_special_ids)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    text = "Hello, world! " + MULTI_BYTE
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_tiny_tokenizer_has_partial_utf8_tokens(tok):
    ids = tok.encode("東")
    assert len(ids) > 1 and all("\ufffd" in tok.decode([i]) for i in ids)


def test_tiny_tokenizer_other_vocab_size(tmp_path):
    t = load_tokenizer(make_tiny_tokenizer(str(tmp_path), vocab_size=600, chat_template=False))
    assert t.vocab_size == 600 and t.chat_template is None
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_tokenizer(str(tmp_path / "small"), vocab_size=100)


def test_load_tokenizer_none_and_missing(tmp_path):
    assert load_tokenizer(None) is None
    assert load_tokenizer(str(tmp_path)) is None  # a model dir without tokenizer files
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_tokenizer_broken_files_raise(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="could not load the tokenizer"):
        load_tokenizer(str(tmp_path))


def test_encode_rejects_non_string(tok):
    with pytest.raises(ValueError, match="string"):
        tok.encode([1, 2])


# ---- chat template ------------------------------------------------------------------------


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    ids = tok.apply_chat_template(messages)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one special token, not text
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected[: -len("<|im_start|>assistant\n")]


def test_chat_template_accepts_text_parts(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    ids = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert ids == tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])


def test_chat_template_assistant_tool_call_without_content(tok):
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=r"tool_calls\[0\].id must be a string"):
        tok.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\] lacks 'role'"),
        ([{"role": "user"}], r"messages\[0\] lacks 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}], r"messages\[1\].role must be one of"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"content\[0\].*only text"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\[0\].text must be a string"),
    ],
)
def test_chat_template_errors(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_no_chat_template_raises(tmp_path):
    t = load_tokenizer(make_tiny_tokenizer(str(tmp_path), chat_template=False))
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_exception_becomes_value_error(tok_dir):
    t = load_tokenizer(tok_dir)
    t.hf.chat_template = "{{ raise_exception('roles must alternate') }}" + CHATML_TEMPLATE
    t.chat_template = t.hf.chat_template
    with pytest.raises(ValueError, match="roles must alternate"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def gguf_tok():
    return bundled_gguf_tokenizer()


@NEEDS_BUNDLED_GGUF
def test_load_tokenizer_from_gguf(gguf_tok):
    t = gguf_tok
    assert t.vocab_size == 49152 and t.eos_token_id == 2
    ids = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert t.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
