"""Incremental detokenization with stop strings: output token ids to stop-safe text deltas, one engine
step at a time (see `IncrementalDetokenizer`)."""

from __future__ import annotations

from typing import Optional, Sequence

from tallyserve.sampling_params import SamplingParams
from tallyserve.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"  # what lossy UTF-8 decoding yields for an incomplete character


class IncrementalDetokenizer:
    """Turns output token ids into stop-safe text deltas, one engine step at a time.

    The concatenated deltas (after `flush()`) equal `tokenizer.decode(output_ids,
    skip_special_tokens=params.skip_special_tokens)` exactly, unless a stop string ended the text.
    A token that ends inside a multi-byte UTF-8 character yields no text until the character
    completes. Text is decoded from the output ids alone (no prompt context), so it matches a
    plain decode of the output ids. With stop strings (and not include_stop_str_in_output), the
    last `max(len(stop)) - 1` characters are held back so a stop string never straddles deltas.
    Stop strings are only looked for once `min_tokens` tokens exist.

    One algorithm, two places to run it: the decode window of `_decode_new` in Python, or, where
    `Tokenizer.decode_stream` gives a tokenizers DecodeStream (byte-level decoders without byte
    tokens), the same window in Rust: one call per update instead of two decodes and the slicing
    around them. The stream returns text exactly when the Python window would, so _prefix/_read
    keep following the window and the Python path takes over where the stream fails, and for
    `flush` (DecodeStream never releases the text it withholds).
    """

    def __init__(
        self, tokenizer: Optional[Tokenizer], prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self.finished = False  # True once a stop string ended the text
        self.stop_reason: Optional[str] = None  # the stop string that ended it
        self._stops = params.stop
        self._hold = 0 if params.include_stop_str_in_output else max(params.max_stop_str_len - 1, 0)
        self._text = ""  # decoded text: emitted + held back
        self._sent = 0  # characters of _text already returned
        # Decode window: ids[_prefix:] is decoded; ids[_prefix:_read] decodes to _prefix_text,
        # which ends on a complete character, so decoding may restart at _prefix cleanly.
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        skip = params.skip_special_tokens
        self._stream = tokenizer.decode_stream(skip) if tokenizer is not None else None
        self._backend = tokenizer.backend if tokenizer is not None else None
        self._byte_ids = tokenizer.byte_token_ids if tokenizer is not None else frozenset()

    @property
    def text(self) -> str:
        """All text so far: what was emitted plus what is held back for stop-string safety."""
        return self._text

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add newly sampled ids; return the text that may be sent now ("" if none).
        Once a stop string has finished the text, further ids are ignored."""
        if self.finished:
            return ""
        ids = self.output_token_ids
        ids.extend(new_token_ids)
        if self._stream is not None:
            n = len(new_token_ids)
            if not n:
                return ""  # the same ids decode to the same (withheld) text
            try:  # one id as an int: the engine's case, and the cheapest call
                new = self._stream.step(self._backend, new_token_ids[0] if n == 1 else list(new_token_ids))
            except Exception:  # noqa: BLE001 - e.g. a tokenizers release whose step takes one id only
                self._leave_stream()
                new = self._decode_new(allow_partial=False)
            else:
                if new is None:
                    return ""
                self._prefix, self._read = self._read, len(ids)
        elif self.tokenizer is None:
            return ""
        else:
            new = self._decode_new(allow_partial=False)
        if not new:
            return ""  # the text did not grow: what may be sent did not either
        if not self._stops:  # nothing to look for, nothing held back
            self._text += new
            self._sent = len(self._text)
            return new
        old_len = len(self._text)
        self._text += new
        if len(ids) >= self.params.min_tokens and self._check_stop(old_len):
            return self._take(len(self._text))
        return self._take(len(self._text) - self._hold)

    def flush(self) -> str:
        """The request is ending: return everything not yet sent, including held-back text and
        a trailing incomplete character (as U+FFFD, like a full decode). The last, so far
        undecodable text may still complete a stop string: check `finished` / `stop_reason`."""
        if self.tokenizer is not None and not self.finished:
            if self._stream is not None:
                # DecodeStream keeps what it withholds to itself; the Python window it was followed
                # by takes over and releases the rest, as the Python path would (two short decodes,
                # where a full decode of the output would cost O(length) per request).
                self._leave_stream()
            new = self._decode_new(allow_partial=True)
            if new:
                old_len = len(self._text)
                self._text += new
                if self._stops and len(self.output_token_ids) >= self.params.min_tokens:
                    self._check_stop(old_len)
        return self._take(len(self._text))

    def _leave_stream(self) -> None:
        """Go on in Python from the window the stream has followed (_prefix/_read)."""
        self._stream = None
        ids = self.output_token_ids[self._prefix : self._read]
        self._prefix_text = self._decode(ids, self.params.skip_special_tokens)

    def _decode_new(self, allow_partial: bool) -> str:
        ids = self.output_token_ids
        if len(ids) == self._read:
            return ""
        skip = self.params.skip_special_tokens
        full = self._decode(ids[self._prefix :], skip)
        if len(full) <= len(self._prefix_text):
            return ""
        if not allow_partial and (full.endswith(_REPLACEMENT_CHAR) or ids[-1] in self._byte_ids):
            return ""  # wait: the last character may be incomplete, or a byte run may go on
        new_text = full[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        self._prefix_text = self._decode(ids[self._prefix : self._read], skip)
        return new_text

    def _decode(self, ids: list[int], skip: bool) -> str:
        if self._backend is not None:  # Tokenizer.decode's path, without its copy of the ids
            return self._backend.decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _check_stop(self, old_len: int) -> bool:
        """Look for stop strings ending in the new text; on a hit truncate _text and finish."""
        # The stop string that completes first wins (ties: the longer one, which starts first),
        # so the result does not depend on how the tokens were grouped into updates.
        best: Optional[tuple[int, int, str]] = None
        text = self._text
        for stop in self._stops:
            start = old_len - len(stop) + 1
            idx = text.find(stop, start if start > 0 else 0)
            if idx >= 0 and (best is None or (idx + len(stop), idx) < best[:2]):
                best = (idx + len(stop), idx, stop)
        if best is None:
            return False
        _, idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self._text = self._text[:end]
        self.finished = True
        self.stop_reason = stop
        return True

    def _take(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta = self._text[self._sent : upto]
        self._sent = upto
        return delta
