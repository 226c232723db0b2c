"""Tiny random models for tests and benchmarks: a random float32 Hugging Face checkpoint of a small Llama /
Mistral / Qwen2 / Qwen3 (``make_tiny_model``) and a byte-level BPE tokenizer built offline (``make_tiny_tokenizer``),
so a run needs no download. ``tests/tiny_models.py`` and ``tests/tiny_tokenizer.py`` re-export them.

The tokenizer: ``make_tiny_tokenizer(dir)`` writes tokenizer.json and tokenizer_config.json (ChatML-style chat
template, eos ``<|endoftext|>``) into ``dir``; ``transformers.AutoTokenizer.from_pretrained(dir)`` and
``tallyserve.tokenizer.load_tokenizer(dir)`` both load it. Drop the files into a tiny random model directory to get
a full text model.

Layout of the vocabulary (exactly `vocab_size` ids):
  0 `<|endoftext|>` (eos), 1 `<|im_start|>`, 2 `<|im_end|>`  special tokens
  3 .. 245       the 243 bytes that can occur in UTF-8 (so any text round-trips; multi-byte
                 characters that no merge covers are split over several partial tokens)
  246 ..         BPE merges learned from the built-in English text below
  tail           `<|reserved_N|>` special tokens if the text ran out of merges
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral")  # mixtures of experts: 8 experts of intermediate size 32, top-2

_TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _hf_config(arch: str, vocab_size: int, tie: bool, rope_scaling: Optional[dict], overrides: dict):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {list(classes)}, got {arch!r}")
    kwargs = dict(_TINY_SHAPE, vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32  # explicit head_dim != hidden / heads, as in real Qwen3
    if arch == "qwen3_moe":
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        kwargs.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None)
    theta = float(overrides.pop("rope_theta", 10000.0))
    # transformers 5 keeps RoPE settings in one nested dict, `rope_parameters`.
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    kwargs.update(overrides)
    return classes[arch](**kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are far from uniform; norms and biases perturbed."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        elif "embed_tokens" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        else:
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def make_tiny_model(
    tmp_dir,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    rope_scaling: Optional[dict] = None,
    seed: int = 0,
    vocab_size: int = 256,
    max_shard_size: Optional[str | int] = None,
    **overrides,
) -> str:
    """Save a random float32 ``transformers`` model of ``arch`` into ``tmp_dir`` (safetensors,
    sharded when ``max_shard_size`` is given, e.g. "100KB") and return the directory.

    ``rope_scaling`` is e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}; ``overrides`` go to the
    config (``rope_theta`` included). No tokenizer files are written."""
    import transformers

    config = _hf_config(arch, vocab_size, tie_word_embeddings, rope_scaling, dict(overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    out = os.fspath(tmp_dir)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


# ----------------------------------------------------------------------------- tokenizer
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
