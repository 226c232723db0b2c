"""IncrementalDetokenizer (tallyserve/detokenizer.py): stop-safe text deltas equal to the full decode, stop
strings, and the DecodeStream path against the Python window."""

import copy
import os
import sys

import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from tests.tiny_tokenizer import NEEDS_BUNDLED_GGUF, TRAINING_TEXT, bundled_gguf_tokenizer, make_tiny_tokenizer  # noqa: E402,E501

from tallyserve.sampling_params import SamplingParams  # noqa: E402
from tallyserve.detokenizer import IncrementalDetokenizer  # noqa: E402
from tallyserve.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

VOCAB = 256
MULTI_BYTE = "é ñ ü 東京 你好 こんにちは 🙂 🚀 👍🏽 𝄞 résumé naïve"
_HYP = settings(max_examples=150, deadline=None)


# ---- incremental detokenization -----------------------------------------------------------


def _stream(tok, ids, params, chunks=None):
    detok = IncrementalDetokenizer(tok, [5, 6, 7], params)
    deltas, i = [], 0
    chunks = list(chunks or [])
    while i < len(ids) and not detok.finished:
        size = chunks.pop(0) if chunks else 1
        deltas.append(detok.update(ids[i : i + size]))
        i += size
    if not detok.finished:
        deltas.append(detok.flush())
    return detok, deltas


@_HYP
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    chunks=st.lists(st.integers(0, 4), max_size=20),
    skip=st.booleans(),
)
def test_incremental_equals_full_decode_random_ids(tok, ids, chunks, skip):
    params = SamplingParams(skip_special_tokens=skip)
    detok, deltas = _stream(tok, ids, params, chunks)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert detok.text == expected and detok.output_token_ids == ids


@pytest.fixture(scope="module")
def byte_fallback_tok():
    """A Llama-2-style tokenizer: Metaspace spaces, <0xNN> byte-fallback tokens, strip decoder."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    rt = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    rt.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rt.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    rt.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(vocab_size=350, special_tokens=specials, show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=rt, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@_HYP
@given(
    ids=st.lists(st.integers(0, 349), max_size=40),
    chunks=st.lists(st.integers(0, 4), max_size=20),
    skip=st.booleans(),
)
def test_incremental_equals_full_decode_byte_fallback(byte_fallback_tok, ids, chunks, skip):
    # ByteFallback turns a whole run of byte tokens into U+FFFDs when the run is not valid
    # UTF-8, so text from a run is only final once the run ends.
    tok = byte_fallback_tok
    assert len(tok.byte_token_ids) == 256
    _, deltas = _stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunks)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_streams_multibyte_text(byte_fallback_tok):
    text = "the cat 東京 🙂 sat"
    ids = byte_fallback_tok.encode(text, add_special_tokens=False)
    _, deltas = _stream(byte_fallback_tok, ids, SamplingParams())
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


@_HYP
@given(text=st.text(alphabet=st.sampled_from(list(MULTI_BYTE + "abc xyz\n,.!")), max_size=30))
def test_streaming_valid_text_never_emits_replacement_char(tok, text):
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == text


def test_special_tokens_kept_when_not_skipped(tok):
    ids = tok.encode("hi") + [2] + tok.encode(" there")
    _, deltas = _stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "hi<|im_end|> there"
    _, deltas = _stream(tok, ids, SamplingParams())
    assert "".join(deltas) == "hi there"


def test_trailing_incomplete_character_comes_out_on_flush(tok):
    ids = tok.encode("ok 🙂")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = "".join(detok.update([i]) for i in ids)
    assert emitted == "ok "
    assert detok.flush() == tok.decode(ids)[len("ok "):]
    assert emitted + "\ufffd" == tok.decode(ids)


def test_no_tokenizer_gives_empty_text():
    detok = IncrementalDetokenizer(None, [1, 2], SamplingParams())
    assert detok.update([3, 4]) == "" and detok.flush() == "" and detok.text == ""
    assert detok.output_token_ids == [3, 4] and not detok.finished
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        IncrementalDetokenizer(None, [], SamplingParams(stop=["x"]))


# ---- stop strings -------------------------------------------------------------------------

TEXT = "Hello, world! How are you today? The capital of France is Paris."


def test_stop_string_truncates(tok):
    detok, deltas = _stream(tok, tok.encode(TEXT), SamplingParams(stop=["you", "capital"]))
    assert "".join(deltas) == "Hello, world! How are "
    assert detok.finished and detok.stop_reason == "you"
    assert detok.text == "Hello, world! How are "
    assert detok.update(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_string_included(tok):
    params = SamplingParams(stop=["today"], include_stop_str_in_output=True)
    detok, deltas = _stream(tok, tok.encode(TEXT), params)
    assert "".join(deltas) == "Hello, world! How are you today"
    assert detok.stop_reason == "today"


def test_first_completed_stop_string_wins(tok):
    detok, deltas = _stream(tok, tok.encode(TEXT), SamplingParams(stop=["Paris", "o"]))
    assert "".join(deltas) == "Hell" and detok.stop_reason == "o"
    # "ello" starts first but "l" completes first, whether the text comes token by token ...
    detok, deltas = _stream(tok, tok.encode(TEXT), SamplingParams(stop=["ello", "l"]))
    assert "".join(deltas) == "He" and detok.stop_reason == "l"
    # ... or in one delta
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["ello", "l"]))
    assert detok.update(tok.encode(TEXT)) == "He" and detok.stop_reason == "l"


def test_stop_string_straddling_two_tokens(tok):
    ids = tok.encode(TEXT)
    pieces = [tok.decode([i]) for i in ids]
    k = next(j for j in range(1, len(ids)) if len(pieces[j - 1]) >= 2 and len(pieces[j]) >= 2)
    prefix = "".join(pieces[: k - 1])
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    assert stop not in prefix + pieces[k - 1]
    detok, deltas = _stream(tok, ids, SamplingParams(stop=[stop]))
    assert detok.finished and "".join(deltas) == (prefix + pieces[k - 1])[:-2]


def test_stop_string_in_multibyte_text(tok):
    text = "abc 東京 def"
    detok, deltas = _stream(tok, tok.encode(text), SamplingParams(stop=["京"]))
    assert "".join(deltas) == "abc 東" and detok.stop_reason == "京"


def test_held_back_text_flushed(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["XYZW"]))
    emitted = "".join(detok.update([i]) for i in tok.encode("Hello"))
    assert emitted == "He" and detok.text == "Hello"
    assert detok.flush() == "llo" and not detok.finished and detok.stop_reason is None


def test_stop_string_found_in_text_released_by_flush(tok):
    # "b" arrives in one update with the first byte of an emoji, so that text waits for the
    # character to complete; the request ends first and flush() still honours the stop string.
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["b"]))
    assert detok.update(tok.encode("xab") + tok.encode("🙂")[:1]) == ""
    assert detok.flush() == "xa" and detok.finished and detok.stop_reason == "b"


def test_stop_strings_ignored_before_min_tokens(tok):
    ids = tok.encode("ab ab ab ab ab")
    params = SamplingParams(stop=["ab"], min_tokens=len(tok.encode("ab ab")) + 1, max_tokens=50)
    detok, deltas = _stream(tok, ids, params)
    assert detok.finished
    out = "".join(deltas)
    assert out.startswith("ab ab") and len(out) < len("ab ab ab ab ab")


@_HYP
@given(
    words=st.lists(st.sampled_from(["the", " cat", " sat", "!", " 東京", "🙂", " on", " mat", "\n"]), max_size=15),
    stops=st.lists(st.sampled_from(["cat", "t s", "at!", "京🙂", "on m", "\n\n", "xyz", "t"]), min_size=1, max_size=3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=10),
)
def test_stop_strings_match_reference_and_never_retract(tok, words, stops, include, chunks):
    text = "".join(words)
    ids = tok.encode(text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    # the stop string that completes first in the text wins (ties: the one that starts first)
    hits = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    if hits:
        end, idx, s = hits[0]
        expected = text[:end] if include else text[:idx]
    else:
        expected = text
    detok = IncrementalDetokenizer(tok, [], params)
    emitted, i, chunks = "", 0, list(chunks)
    while i < len(ids) and not detok.finished:
        size = chunks.pop(0) if chunks else 1
        emitted += detok.update(ids[i : i + size])
        i += size
        assert expected.startswith(emitted)  # never emits text it would have to take back
        if not include and not detok.finished:
            for s in stops:  # nothing emitted can be the start of a stop string still forming
                assert s not in emitted
    emitted += detok.flush()
    assert emitted == expected
    assert detok.finished == bool(hits) and detok.stop_reason == (hits[0][2] if hits else None)


# ---- streaming decode: DecodeStream vs the Python window ----------------------------------


def _python_path(tok):
    """The same tokenizer with DecodeStream off: IncrementalDetokenizer decodes in Python (the
    path of tokenizers it cannot stream exactly)."""
    slow = copy.copy(tok)
    slow._stream_class = None
    return slow


@pytest.fixture(scope="module")
def tok600(tmp_path_factory):
    """More merges than `tok`: multi-byte characters come as whole tokens, partly merged bytes,
    or single bytes."""
    return load_tokenizer(make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok600")), vocab_size=600))


@pytest.fixture(scope="module", params=["vocab256", "vocab600"])
def stream_pair(request, tok, tok600):
    fast = tok if request.param == "vocab256" else tok600
    return fast, _python_path(fast)


def _stream_on_stream_path(tok, ids, params, chunks=None):
    """`_stream`, checking that every update ran on DecodeStream (flush always leaves it)."""
    detok = IncrementalDetokenizer(tok, [5, 6, 7], params)
    assert detok._stream is not None
    deltas, i, chunks = [], 0, list(chunks or [])
    while i < len(ids) and not detok.finished:
        size = chunks.pop(0) if chunks else 1
        deltas.append(detok.update(ids[i : i + size]))
        i += size
        assert detok._stream is not None
    if not detok.finished:
        deltas.append(detok.flush())
    return detok, deltas


@st.composite
def _output_ids(draw, tok):
    """Ids a model could sample: text with multi-byte characters (its first ids sometimes cut
    off, so a character starts mid-way), special tokens (empty text when skipped), ids outside
    the tokenizer's vocabulary (no text) and arbitrary ids (mostly partial UTF-8 bytes)."""
    vocab = tok.backend.get_vocab_size()
    piece = st.one_of(
        st.tuples(st.text(alphabet=st.sampled_from(list(MULTI_BYTE + 'ab {}":,\n')), min_size=1, max_size=8),
                  st.integers(0, 2)).map(lambda t: tok.encode(t[0], add_special_tokens=False)[t[1]:]),
        st.sampled_from(tok.all_special_ids).map(lambda i: [i]),
        st.integers(vocab, vocab + 8).map(lambda i: [i]),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3),
    )
    return [i for ids in draw(st.lists(piece, max_size=12)) for i in ids]


def test_stream_decoding_only_where_exact(tok, tok600, byte_fallback_tok):
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    for t in (tok, tok600):  # byte-level decoder, no byte tokens
        assert t.decode_stream() is not None
        assert IncrementalDetokenizer(t, [], SamplingParams())._stream is not None
    assert byte_fallback_tok.decode_stream() is None  # <0xNN> byte runs: the Python path waits them out
    assert IncrementalDetokenizer(byte_fallback_tok, [], SamplingParams())._stream is None
    rt = RustTokenizer(models.BPE(unk_token="<unk>"))  # SentencePiece-style spaces, no byte tokens
    rt.pre_tokenizer = pre_tokenizers.Metaspace()
    rt.decoder = decoders.Metaspace()
    rt.train_from_iterator([TRAINING_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                                show_progress=False))
    metaspace = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rt, unk_token="<unk>"))
    assert not metaspace.byte_token_ids and metaspace.decode_stream() is None
    ids = metaspace.encode("the cat sat on the mat")
    _, deltas = _stream(metaspace, ids, SamplingParams())
    assert "".join(deltas) == metaspace.decode(ids) == "the cat sat on the mat"


@_HYP
@given(data=st.data(), chunks=st.lists(st.integers(0, 4), max_size=20), skip=st.booleans())
def test_stream_decoding_equals_python_path_and_full_decode(stream_pair, data, chunks, skip):
    fast, slow = stream_pair
    ids = data.draw(_output_ids(fast))
    params = SamplingParams(skip_special_tokens=skip)
    fast_detok, fast_deltas = _stream_on_stream_path(fast, ids, params, chunks)
    slow_detok, slow_deltas = _stream(slow, ids, params, chunks)
    assert fast_deltas == slow_deltas  # the same text from every update, not only in total
    assert "".join(fast_deltas) == fast_detok.text == fast.decode(ids, skip_special_tokens=skip)


@_HYP
@given(
    data=st.data(),
    words=st.lists(st.sampled_from(["the", " cat", " sat", "!", " 東京", "🙂", " on", "\n", "<|im_end|>"]),
                   max_size=15),
    stops=st.lists(st.sampled_from(["cat", "t s", "京🙂", "\n\n", "🙂", "xyz", "t", "<|im_end|>", "\ufffd"]),
                   min_size=1, max_size=3),
    include=st.booleans(),
    skip=st.booleans(),
    min_tokens=st.integers(0, 6),
    chunks=st.lists(st.integers(0, 3), max_size=10),
)
def test_stream_decoding_stop_strings_equal_python_path(stream_pair, data, words, stops, include, skip,
                                                         min_tokens, chunks):
    fast, slow = stream_pair
    ids = fast.encode("".join(words)) + data.draw(_output_ids(fast))  # then partial bytes, specials, ...
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, skip_special_tokens=skip,
                            min_tokens=min_tokens, max_tokens=100)
    fast_detok, fast_deltas = _stream_on_stream_path(fast, ids, params, chunks)
    slow_detok, slow_deltas = _stream(slow, ids, params, chunks)
    assert fast_deltas == slow_deltas
    assert fast_detok.text == slow_detok.text == "".join(fast_deltas)
    assert (fast_detok.finished, fast_detok.stop_reason) == (slow_detok.finished, slow_detok.stop_reason)
    if not fast_detok.finished:
        assert fast_detok.text == fast.decode(ids, skip_special_tokens=skip)


class _FailingStream:
    """A DecodeStream whose `fail_at`-th step raises (as a tokenizers release that takes one id
    per step does when given several)."""

    def __init__(self, stream, fail_at):
        self.stream, self.fail_at, self.calls = stream, fail_at, 0

    def step(self, tokenizer, ids):
        self.calls += 1
        if self.calls == self.fail_at:
            raise TypeError("StreamInput must be either an integer or a list of integers")
        return self.stream.step(tokenizer, ids)


@_HYP
@given(data=st.data(), chunks=st.lists(st.integers(1, 4), max_size=20), fail_at=st.integers(1, 25),
       skip=st.booleans())
def test_stream_failure_hands_over_to_the_python_window(tok, data, chunks, fail_at, skip):
    ids = data.draw(_output_ids(tok))
    params = SamplingParams(skip_special_tokens=skip)
    _, expected = _stream(_python_path(tok), ids, params, chunks)
    detok = IncrementalDetokenizer(tok, [5, 6, 7], params)
    detok._stream = _FailingStream(detok._stream, fail_at)
    deltas, i, chunks = [], 0, list(chunks)
    while i < len(ids):
        size = chunks.pop(0) if chunks else 1
        deltas.append(detok.update(ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    assert deltas == expected and "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_flush_releases_what_the_stream_withholds(tok):
    ids = tok.encode("ok 東京 🙂")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = "".join(detok.update([i]) for i in ids[:-1] + [0])  # cut inside the emoji, then EOS
    assert emitted == "ok 東京 " and detok.flush() == "\ufffd" and detok.flush() == ""
    assert detok._stream is None  # the Python window took over to release it
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["🙂"]))  # holds nothing back (length 1)
    assert "".join(detok.update([i]) for i in ids[:-1] + [0]) == "ok 東京 "
    assert detok.flush() == "\ufffd" and not detok.finished  # the stop string never completed
    detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    emitted = "".join(detok.update([i]) for i in ids + [0])
    assert emitted == "ok 東京 🙂<|endoftext|>" and detok.flush() == ""


@pytest.fixture(scope="module")
def gguf_tok():
    return bundled_gguf_tokenizer()


@NEEDS_BUNDLED_GGUF
@_HYP
@given(data=st.data(), chunks=st.lists(st.integers(0, 4), max_size=20), skip=st.booleans())
def test_stream_decoding_bundled_tokenizer(gguf_tok, data, chunks, skip):
    # the bundled model's tokenizer (SmolLM2's byte-level BPE, 49152 ids) streams through DecodeStream
    ids = data.draw(_output_ids(gguf_tok))
    params = SamplingParams(skip_special_tokens=skip)
    _, fast_deltas = _stream_on_stream_path(gguf_tok, ids, params, chunks)
    _, slow_deltas = _stream(_python_path(gguf_tok), ids, params, chunks)
    assert fast_deltas == slow_deltas
    assert "".join(fast_deltas) == gguf_tok.decode(ids, skip_special_tokens=skip)
