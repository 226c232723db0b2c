"""Workloads: seeded, deterministic lists of request specs shared by `bench` and `simulate`.

A workload is a flat list of `RequestSpec`. Requests with the same `conversation_id` form a
conversation: turn k+1 is sent `think_time_s` after turn k completed (and not before its own
`arrival_s`, if it has one), with the whole history (earlier messages plus the replies the
server gave) in front of its new messages. A request without a conversation stands alone.

Kinds (``--workload``):
  random          prompts of random words; input/output lengths from --random-input-len,
                  --random-output-len and --random-range-ratio (uniform in len*(1 -+ ratio))
  shared-prefix   --shared-prefix-groups groups, each sharing a --shared-prefix-len prefix,
                  plus a unique --shared-prefix-suffix-len suffix per request
  multi-turn      chat conversations of --multi-turn-turns turns: a shared system prompt,
                  user messages of --multi-turn-user-len words, exponential think time
  file:PATH       a JSONL trace or a ShareGPT JSON file (see `tallyserve.bench.traces`)

Lengths of synthetic text are in words: one word is one token for the simulator's tokenizer.
`tallyserve bench` makes random and shared-prefix lengths exact token counts of the served model
(`bench/token_lengths.py`); multi-turn chat lengths stay in words (about two tokens each).
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional

WORKLOAD_KINDS = ("random", "shared-prefix", "multi-turn", "file:PATH")


@dataclass
class RequestSpec:
    request_id: str
    max_tokens: int
    prompt: Optional[str] = None  # completion prompt text
    prompt_token_ids: Optional[list[int]] = None  # completion prompt as token ids
    messages: Optional[list[dict]] = None  # chat messages (a conversation turn: the new ones)
    arrival_s: Optional[float] = None  # earliest send time, seconds after the start
    conversation_id: Optional[str] = None
    turn: int = 0
    think_time_s: float = 0.0  # pause after the previous turn of the conversation completed

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        return out


@dataclass
class WorkloadOptions:
    """Every workload flag; `from_namespace` reads them from argparse."""

    workload: str = "random"
    num_requests: int = 100
    seed: int = 0
    request_rate: float = math.inf
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    shared_prefix_groups: int = 8
    shared_prefix_len: int = 1024
    shared_prefix_suffix_len: int = 64
    multi_turn_turns: int = 6
    multi_turn_user_len: int = 128
    multi_turn_system_len: int = 256
    think_time: float = 1.0
    max_tokens: Optional[int] = None  # overrides every request's max_tokens

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, **overrides: Any) -> "WorkloadOptions":
        given = {k: getattr(ns, k) for k in cls.__dataclass_fields__ if getattr(ns, k, None) is not None}
        given.update(overrides)
        return cls(**given)

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not (self.request_rate > 0):
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        for name in ("random_input_len", "random_output_len", "shared_prefix_groups", "multi_turn_turns",
                     "multi_turn_user_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("shared_prefix_len", "shared_prefix_suffix_len", "multi_turn_system_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.think_time < 0:
            raise ValueError(f"think_time must be >= 0, got {self.think_time}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class Workload:
    name: str
    requests: list[RequestSpec]
    options: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def conversations(self) -> list[list[RequestSpec]]:
        """Requests grouped into conversations (a lone request is a one-turn conversation),
        turns in order, conversations ordered by the arrival of their first turn."""
        groups: dict[str, list[RequestSpec]] = {}
        for spec in self.requests:
            key = spec.conversation_id if spec.conversation_id is not None else "\0" + spec.request_id
            groups.setdefault(key, []).append(spec)
        convs = list(groups.values())
        convs.sort(key=lambda c: c[0].arrival_s or 0.0)  # stable: file order breaks ties
        return convs


# ----------------------------------------------------------------- synthetic text
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]
WORDS: tuple[str, ...] = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)  # 4900 pseudo-words


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choices(WORDS, k=num_words))


def sample_len(rng: random.Random, length: int, ratio: float) -> int:
    """Uniform integer in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    lo, hi = int(length * (1 - ratio)), int(length * (1 + ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


# ----------------------------------------------------------------- builders
def _build_random(opts: WorkloadOptions, rng: random.Random) -> list[RequestSpec]:
    out = []
    for i in range(opts.num_requests):
        n_in = sample_len(rng, opts.random_input_len, opts.random_range_ratio)
        n_out = sample_len(rng, opts.random_output_len, opts.random_range_ratio)
        out.append(RequestSpec(f"random-{i}", n_out, prompt=random_text(rng, n_in)))
    return out


def _build_shared_prefix(opts: WorkloadOptions, rng: random.Random) -> list[RequestSpec]:
    prefixes = [random_text(rng, opts.shared_prefix_len) for _ in range(opts.shared_prefix_groups)]
    out = []
    for i in range(opts.num_requests):
        group = rng.randrange(opts.shared_prefix_groups)
        suffix = random_text(rng, max(1, opts.shared_prefix_suffix_len))
        prompt = f"{prefixes[group]} {suffix}" if prefixes[group] else suffix
        n_out = sample_len(rng, opts.random_output_len, opts.random_range_ratio)
        out.append(RequestSpec(f"shared-{i}", n_out, prompt=prompt))
    return out


def _build_multi_turn(opts: WorkloadOptions, rng: random.Random) -> list[RequestSpec]:
    system = random_text(rng, opts.multi_turn_system_len) if opts.multi_turn_system_len else ""
    out: list[RequestSpec] = []
    conv = 0
    while len(out) < opts.num_requests:
        turns = min(sample_len(rng, opts.multi_turn_turns, opts.random_range_ratio), opts.num_requests - len(out))
        for t in range(turns):
            user = {"role": "user", "content": random_text(rng, sample_len(rng, opts.multi_turn_user_len,
                                                                              opts.random_range_ratio))}
            messages = [{"role": "system", "content": system}, user] if (t == 0 and system) else [user]
            think = rng.expovariate(1.0 / opts.think_time) if (t and opts.think_time > 0) else 0.0
            n_out = sample_len(rng, opts.random_output_len, opts.random_range_ratio)
            out.append(RequestSpec(f"conv{conv}-turn{t}", n_out, messages=messages, conversation_id=f"conv{conv}",
                                   turn=t, think_time_s=think))
        conv += 1
    return out


def assign_arrivals(requests: list[RequestSpec], rate: float, rng: random.Random, per_conversation: float = 1.0) -> None:
    """Poisson arrivals for first turns that have none. A conversation carries
    `per_conversation` requests on average, so conversations start at rate / that: the
    offered load is `rate` requests per second. An infinite rate starts everything at 0."""
    t = 0.0
    conv_rate = rate / max(per_conversation, 1.0)
    seen: set[str] = set()
    for spec in requests:
        if spec.conversation_id is not None:
            if spec.conversation_id in seen:
                continue
            seen.add(spec.conversation_id)
        if spec.arrival_s is not None:
            continue
        if math.isfinite(conv_rate):
            t += rng.expovariate(conv_rate)
        spec.arrival_s = t if math.isfinite(conv_rate) else 0.0


def build_workload(opts: WorkloadOptions) -> Workload:
    opts.validate()
    rng = random.Random(opts.seed)
    kind = opts.workload
    if kind == "random":
        reqs = _build_random(opts, rng)
    elif kind == "shared-prefix":
        reqs = _build_shared_prefix(opts, rng)
    elif kind == "multi-turn":
        reqs = _build_multi_turn(opts, rng)
    elif kind.startswith("file:"):
        from tallyserve.bench.traces import load_trace

        reqs = load_trace(kind[len("file:"):], opts.num_requests, default_max_tokens=opts.random_output_len)
    else:
        raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(WORKLOAD_KINDS)}")
    ids = [s.request_id for s in reqs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"workload {kind!r}: request id {dup!r} is used more than once")
    if opts.max_tokens is not None:
        for spec in reqs:
            spec.max_tokens = opts.max_tokens
    convs = {s.conversation_id for s in reqs if s.conversation_id is not None}
    singles = sum(1 for s in reqs if s.conversation_id is None)
    per_conv = len(reqs) / max(1, len(convs) + singles)
    assign_arrivals(reqs, opts.request_rate, random.Random(f"arrivals-{opts.seed}"), per_conv)
    return Workload(kind, reqs, dict(opts.__dict__))


def add_workload_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default=None,
                   help="random (default) | shared-prefix | multi-turn | file:PATH (JSONL trace or ShareGPT JSON)")
    g.add_argument("--num-requests", type=int, default=None, help="requests (turns) to send (default 100; "
                   "a file trace defaults to all of it)")
    if with_seed:
        g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests per second, Poisson arrivals (default inf: all at once); conversations "
                   "start at this rate / their mean number of turns, so the offered load is this rate")
    g.add_argument("--random-input-len", type=int, default=None,
                   help="prompt tokens per request (bench: exact, with a tokenizer; simulate: words = tokens)")
    g.add_argument("--random-output-len", type=int, default=None)
    g.add_argument("--random-range-ratio", type=float, default=None)
    g.add_argument("--shared-prefix-groups", type=int, default=None)
    g.add_argument("--shared-prefix-len", type=int, default=None)
    g.add_argument("--shared-prefix-suffix-len", type=int, default=None)
    g.add_argument("--multi-turn-turns", type=int, default=None)
    g.add_argument("--multi-turn-user-len", type=int, default=None)
    g.add_argument("--multi-turn-system-len", type=int, default=None)
    g.add_argument("--think-time", type=float, default=None, help="mean think time between turns, seconds")
    g.add_argument("--max-tokens", type=int, default=None, help="override every request's max_tokens")


def workload_from_args(ns: argparse.Namespace, **overrides: Any) -> Workload:
    opts = WorkloadOptions.from_namespace(ns, **overrides)
    if ns.num_requests is None and "num_requests" not in overrides:
        opts.num_requests = 1 << 62 if opts.workload.startswith("file:") else 100
    return build_workload(opts)
