import dataclasses
import re

import pytest

from tallyserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.ignore_eos is False and p.logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    "temperature, greedy", [(0.0, True), (0, True), (1e-6, True), (1e-5, False), (0.7, False), (2, False)]
)
def test_greedy_detection(temperature, greedy):
    p = SamplingParams(temperature=temperature)
    assert p.is_greedy is greedy
    assert (p.sampling_type == SamplingType.GREEDY) is greedy
    assert isinstance(p.temperature, float)


def test_sampling_type_seeded():
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(seed=3, temperature=0).sampling_type == SamplingType.GREEDY


BAD = [
    ("n", 0), ("n", -1), ("n", 1.0), ("n", True), ("n", "2"),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("temperature", True), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")), ("top_p", False),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", None),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", "0.1"),
    ("seed", 1.0), ("seed", "42"), ("seed", True), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0), ("max_tokens", False),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0), ("min_tokens", True),
    ("logprobs", -1), ("logprobs", 2.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", 1.0), ("prompt_logprobs", True),
    ("stop", ""), ("stop", ["a", ""]), ("stop", [1]), ("stop", ["a", None]), ("stop", 5), ("stop", b"x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_raise_value_error_naming_the_field(field, value):
    # the message starts with the field's name (or one element of it, e.g. stop[1]) and says what it must be:
    # a bare match=field would pass for "n" on almost any message
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}(\[\d+\])? must be "):
        SamplingParams(**{field: value})


def test_min_tokens_bounded_by_max_tokens_message():
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_range_messages_name_allowed_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"logprobs must be an integer >= 0, got -1"):
        SamplingParams(logprobs=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=4), dict(temperature=0), dict(top_p=1e-9), dict(top_p=1), dict(top_k=-1), dict(top_k=50),
        dict(min_p=0), dict(min_p=1), dict(seed=0), dict(seed=-7), dict(seed=2**64 - 1),
        dict(max_tokens=None, min_tokens=1000), dict(max_tokens=1), dict(min_tokens=16),
        dict(logprobs=0), dict(logprobs=20), dict(stop_token_ids=[0, 5]),
        dict(logprobs=50), dict(prompt_logprobs=0), dict(prompt_logprobs=50),  # the engine caps both
    ],
)
def test_good_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    default = SamplingParams()
    for f in dataclasses.fields(SamplingParams):  # the values given, as given (sequences as tuples); the rest default
        want = kwargs.get(f.name, getattr(default, f.name))
        got = getattr(p, f.name)
        assert got == (tuple(want) if isinstance(want, list) else want), f.name
        if got is not None and getattr(default, f.name) is not None:  # ints stay ints, floats become floats
            assert type(got) is type(getattr(default, f.name)), f.name
    assert p == SamplingParams(**kwargs) and p.clone() == p  # valid again when re-validated


def test_stop_normalised_to_tuples():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("x",)).stop == ("x",)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop=["ab", "abcd"]).max_stop_str_len == 4
    assert SamplingParams().max_stop_str_len == 0


def test_frozen_and_clone_revalidates():
    p = SamplingParams(temperature=0.5, stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    q = p.clone(max_tokens=100)
    assert q.max_tokens == 100 and q.temperature == 0.5 and q.stop == ("x",)
    assert p.max_tokens == 16
    assert dataclasses.replace(p, n=2).n == 2
    with pytest.raises(ValueError, match="max_tokens"):
        p.clone(max_tokens=0)
    with pytest.raises(ValueError, match="unknown SamplingParams field"):
        p.clone(beam_width=2)


def test_equal_params_hash_equal():
    a = SamplingParams(stop=["x"], stop_token_ids=[1])
    b = SamplingParams(stop="x", stop_token_ids=(1,))
    assert a == b and hash(a) == hash(b)


def test_stop_strings_must_be_valid_unicode():
    with pytest.raises(ValueError, match=r"stop\[1\] is not valid Unicode"):
        SamplingParams(stop=["ok", "abc\ud800def"])
