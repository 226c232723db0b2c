"""SamplingParams: validated, immutable per-request generation options (vLLM-compatible names).

The object is a frozen dataclass: the scheduler shares one instance between the engine and the
runner, so nothing may change it after validation. Derive a modified copy with `clone(**changes)`
(or `dataclasses.replace`), which validates again.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Sequence, Union

# Temperatures below this are treated as greedy decoding (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# Most top logprobs a request may ask for by default (OpenAI's limit; the engine's max_logprobs).
MAX_LOGPROBS = 20
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if not _is_int(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def _check_float(name: str, value: Any, allowed: str, ok) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a number ({allowed}), got {value!r} ({type(value).__name__})")
    value = float(value)
    if math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_unicode(name: str, text: str) -> str:
    """ValueError unless `text` is valid Unicode (no lone surrogates: they cannot be encoded)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate at index {exc.start}") from None
    return text


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise ValueError(f"stop[{i}] must be a string, got {s!r} ({type(s).__name__})")
        if not s:
            raise ValueError(f"stop[{i}] must be a non-empty string")
        check_unicode(f"stop[{i}]", s)
    return tuple(stop)


def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
    return tuple(_check_int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(ids))


def _normalise_logit_bias(bias: Any) -> Optional[dict[int, float]]:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        tid = key
        if isinstance(key, str):  # OpenAI sends token ids as JSON object keys (strings)
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if not _is_int(tid) or tid < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        out[tid] = _check_float(f"logit_bias[{tid}]", value, "in [-100, 100]", lambda v: -100 <= v <= 100)
    return out or None


def _normalise_id_list(name: str, ids: Any) -> Optional[tuple[int, ...]]:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers >= 0, got {ids!r}")
    return tuple(_check_int(f"{name}[{i}]", t, 0) for i, t in enumerate(ids))


def _normalise_bad_words(words: Any) -> tuple[str, ...]:
    if words is None:
        return ()
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}")
    for i, w in enumerate(words):
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"bad_words[{i}] must be a non-empty string, got {w!r}")
        check_unicode(f"bad_words[{i}]", w)
    return tuple(words)


def _normalise_bad_words_token_ids(seqs: Any) -> Optional[tuple[tuple[int, ...], ...]]:
    if seqs is None:
        return None
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, (list, tuple)):
        raise ValueError(f"bad_words_token_ids must be a list of lists of token ids, got {seqs!r}")
    out = []
    for i, seq in enumerate(seqs):
        ids = _normalise_id_list(f"bad_words_token_ids[{i}]", seq)
        if not ids:
            raise ValueError(f"bad_words_token_ids[{i}] must be a non-empty list of token ids")
        out.append(ids)
    return tuple(out)


def bad_words_to_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word as written without a leading space, and with
    one (a distinct tokenization of the same length is added too, as vLLM does)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for prefix_space in (False, True):
            text = (" " if prefix_space else "") + word.lstrip()
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                continue
            if not prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of
    json (a JSON schema, as a dict or a JSON string), regex, choice (the output is one of these
    strings), grammar (EBNF / GBNF), json_object (any JSON object) or structural_tag (a JSON
    string). disable_any_whitespace: no optional whitespace in generated JSON.
    disable_additional_properties: objects of a schema take no keys beyond ``properties``.
    whitespace_pattern: a regex for the whitespace JSON may contain."""

    json: Union[None, str, dict] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object "
                             f"or structural_tag; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs.{name} must be a non-empty string")
                check_unicode(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            for i, c in enumerate(self.choice):
                if not isinstance(c, str):
                    raise ValueError(f"structured_outputs.choice[{i}] must be a string, got {c!r}")
                check_unicode(f"structured_outputs.choice[{i}]", c)
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            _check_bool(f"structured_outputs.{name}", getattr(self, name))

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options. Defaults and meanings follow vLLM.

    n: number of completions to return. temperature: 0 (< 1e-5) means greedy.
    top_p in (0, 1], top_k (0 or -1 = disabled), min_p in [0, 1]: filters applied after
    temperature. seed: per-request seed (same seed, same tokens). max_tokens: None means up to
    the model's max length (the engine resolves it). min_tokens: stop strings, stop token ids and
    EOS are ignored until this many tokens exist. stop: strings that end generation (excluded from
    the output unless include_stop_str_in_output). stop_token_ids: extra ids that end generation.
    ignore_eos: keep going past EOS. logprobs: number of top logprobs to return per token
    besides the sampled one (None: none). skip_special_tokens: omit special tokens from text.

    Penalties and token controls (vLLM semantics, applied on the device by runner/penalties.py):
    presence_penalty / frequency_penalty in [-2, 2]: ``logit - presence * (count > 0) - frequency
    * count`` over the OUTPUT tokens generated so far. repetition_penalty > 0 (1 = off): over the
    prompt AND output tokens, positive logits are divided by it, negative ones multiplied (HF).
    logit_bias: token id -> bias in [-100, 100], added to the logits (ids must be < the vocabulary
    size; the server rejects larger ones with a 400, the runner ignores them). allowed_token_ids:
    only these ids may be sampled. bad_words: strings never to generate; the runner bans their
    token sequences from ``bad_words_token_ids`` (a single-token word always, a longer one when
    the tokens generated last equal its prefix). The server fills bad_words_token_ids with its
    tokenizer; offline, pass bad_words_token_ids, or ``with_bad_words_tokenized(tokenizer)``.
    Greedy rows apply them too (they change the argmax). Log-probabilities stay those of the raw
    model distribution.

    prompt_logprobs: top logprobs to return for every prompt token (0: only the prompt token's
    own), in RequestOutput.prompt_logprobs (vLLM's shape); such a request computes its whole prompt
    (no prefix-cache hit). The engine caps logprobs and prompt_logprobs at its max_logprobs (20 by
    default). structured_outputs: a constraint on the output (StructuredOutputsParams).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    bad_words_token_ids: Optional[Sequence[Sequence[int]]] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through object.__setattr__, once, here
        _check_int("n", self.n, 1)
        set_(self, "temperature", _check_float(
            "temperature", self.temperature, "finite and >= 0", lambda v: 0 <= v < math.inf
        ))
        set_(self, "top_p", _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1))
        _check_int("top_k", self.top_k, -1)
        set_(self, "min_p", _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1))
        if self.seed is not None:
            _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        set_(self, "stop", _normalise_stop(self.stop))
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        # no upper bound here: the engine holds both to its max_logprobs (20 by default, OpenAI's limit)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _check_float(name, getattr(self, name), "in [-2, 2]", lambda v: -2 <= v <= 2))
        set_(self, "repetition_penalty", _check_float(
            "repetition_penalty", self.repetition_penalty, "finite and > 0", lambda v: 0 < v < math.inf
        ))
        set_(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        set_(self, "allowed_token_ids", _normalise_id_list("allowed_token_ids", self.allowed_token_ids))
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        set_(self, "bad_words", _normalise_bad_words(self.bad_words))
        set_(self, "bad_words_token_ids", _normalise_bad_words_token_ids(self.bad_words_token_ids))

    # ---- derived ---------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def uses_history(self) -> bool:
        """Whether sampling needs the request's token history (penalties, multi-token bad words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or any(len(w) > 1 for w in self.bad_words_token_ids or ()))

    @property
    def has_logits_processing(self) -> bool:
        """Whether any penalty or token control changes this request's logits."""
        return (self.uses_history or self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def with_bad_words_tokenized(self, tokenizer: Any) -> "SamplingParams":
        """A copy whose bad_words_token_ids holds the tokenization of bad_words (vLLM's rule)."""
        if not self.bad_words:
            return self
        ids = bad_words_to_token_ids(self.bad_words, tokenizer)
        return self.clone(bad_words_token_ids=tuple(self.bad_words_token_ids or ()) + ids)

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied (e.g. the engine resolving max_tokens)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(sorted(unknown))}")
        return replace(self, **changes)
