"""Fixtures shared by the unit tests of tokenizer loading and detokenization: a tiny byte-level BPE tokenizer
(256 ids, with a chat template) built offline."""

import pytest

from tallyserve.tokenizer import Tokenizer, load_tokenizer
from tests.tiny_tokenizer import make_tiny_tokenizer

TINY_VOCAB = 256


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir):
    t = load_tokenizer(tok_dir)
    assert isinstance(t, Tokenizer)
    return t
