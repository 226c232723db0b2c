"""Engine-level fuzzing: thousands of random requests with random (often hostile) parameters,
aborts, beam search groups and injected step faults, driven through the real LLMEngine on a tiny
model and a small KV pool. The loop must survive every step, every accepted request must end, and
no KV block may leak. Invalid parameters must be rejected with ValueError at add time, never by a
failing step."""

from __future__ import annotations

import math
import random
import warnings

import pytest

from tallyserve.config import EngineArgs
from tallyserve.engine.beam_search import BeamSearchParams
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

EXTREME_FLOATS = (0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 2.0, 1e5, 1e308, -1.0, -1e308,
                  math.inf, -math.inf, math.nan)
EXTREME_INTS = (-(2**63), -1, 0, 1, 2, 3, 7, 2**31, 2**63, 2**64 - 1, 2**64)
STOPS = (None, "a", ["zz", "b"], "\n", "\ufffd", "abc\ud800def", "", [""], 5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fuzz"), "llama", seed=3)
    make_tiny_tokenizer(path)
    return path


def _pick(rng: random.Random, normal, hostile, p_hostile: float = 0.15):
    return rng.choice(hostile) if rng.random() < p_hostile else normal


def _random_params(rng: random.Random) -> dict:
    """Mostly sane sampling parameters, each field hostile with some probability."""
    kw = dict(
        n=_pick(rng, rng.choice((1, 1, 2, 3)), EXTREME_INTS, 0.05),
        temperature=_pick(rng, rng.choice((0.0, 0.7, 1.0, 1.5)), EXTREME_FLOATS),
        top_p=_pick(rng, rng.choice((1.0, 0.9, 0.3)), EXTREME_FLOATS),
        top_k=_pick(rng, rng.choice((0, -1, 1, 5, 50)), EXTREME_INTS),
        min_p=_pick(rng, rng.choice((0.0, 0.05, 0.5)), EXTREME_FLOATS),
        seed=_pick(rng, rng.choice((None, rng.randrange(1000))), EXTREME_INTS),
        max_tokens=_pick(rng, rng.randint(1, 8), EXTREME_INTS, 0.05),
        min_tokens=_pick(rng, rng.choice((0, 0, 1, 3)), EXTREME_INTS, 0.05),
        stop=_pick(rng, None, STOPS, 0.3),
        stop_token_ids=_pick(rng, None, ([3, 4], [0], [-1], [2**70], "x"), 0.1),
        ignore_eos=rng.random() < 0.5,
        logprobs=_pick(rng, rng.choice((None, None, 0, 3)), EXTREME_INTS, 0.1),
    )
    if kw["n"] not in (1, 2, 3):  # a valid huge n would only be slow
        kw["n"] = rng.choice((0, -1, 2**63))
    if isinstance(kw["max_tokens"], int) and kw["max_tokens"] > 8 and kw["max_tokens"] < 2**62:
        kw["max_tokens"] = 2**63  # length-capped by max_model_len
    return kw


def _random_prompt(rng: random.Random, vocab: int):
    r = rng.random()
    if r < 0.05:
        return rng.choice(([], [vocab], [-1], [1.5], "", "abc\ud800def", {"nope": 1}, None, [True]))
    if r < 0.35:
        return "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(1, 40)))
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    return {"prompt_token_ids": ids} if r < 0.7 else ids


def _random_beam(rng: random.Random):
    return dict(beam_width=rng.choice((1, 2, 3, 0)), max_tokens=rng.choice((1, 3, 5, 0)),
                ignore_eos=rng.random() < 0.5,
                length_penalty=_pick(rng, rng.choice((1.0, 0.0, 2.0, -1.0)),
                                     (1e308, 2000.0, -1e308, math.nan, math.inf, 10.0, -10.0), 0.3))


def _fuzz(model_dir: str, seed: int, num_requests: int, async_scheduling: bool) -> dict:
    rng = random.Random(seed)
    args = EngineArgs(model=model_dir, num_gpu_blocks_override=48, block_size=4, max_num_batched_tokens=32,
                      max_num_seqs=12, max_model_len=96, async_scheduling=async_scheduling, seed=seed)
    engine = LLMEngine(args)
    vocab = engine.model_config.vocab_size
    faults = {"armed": 0, "fired": 0}

    def injector(_so):
        if faults["armed"]:
            faults["armed"] -= 1
            faults["fired"] += 1
            raise RuntimeError("injected step fault")

    engine.fault_injector = injector
    accepted, rejected, groups, ended, reported, steps = set(), 0, set(), set(), set(), 0
    scored, plp_rng = set(), random.Random(seed + 7919)  # requests with prompt_logprobs
    next_id = 0
    warnings.simplefilter("error", RuntimeWarning)  # e.g. an overflowing cast of a parameter
    while next_id < num_requests or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4) if next_id < num_requests else 0):
            rid = f"r{next_id}"
            next_id += 1
            try:
                if rng.random() < 0.08:
                    engine.add_beam_search_request(rid, _random_prompt(rng, vocab), BeamSearchParams(**_random_beam(rng)))
                    groups.add(rid)
                else:
                    kw = _random_params(rng)  # prompt_logprobs from its own stream: the others' draws stay as they were
                    kw["prompt_logprobs"] = _pick(plp_rng, plp_rng.choice((None, None, None, 0, 2)), EXTREME_INTS, 0.05)
                    params = SamplingParams(**kw)
                    engine.add_request(rid, _random_prompt(rng, vocab), params)
                    if params.prompt_logprobs is not None:
                        scored.add(rid)
                accepted.add(rid)
            except ValueError:  # bad input is a ValueError at add time, never a TypeError or a failed step
                rejected += 1
        if accepted - ended and rng.random() < 0.05:
            victim = rng.choice(sorted(accepted - ended))
            if victim in groups:
                engine.beams.abort(victim)
            else:
                engine.abort_request(victim)
            ended.add(victim)
        if rng.random() < 0.01:
            faults["armed"] = 1
        for out in engine.step():  # must never raise
            if out.finished:
                assert out.request_id not in reported, f"{out.request_id} finished twice"
                reported.add(out.request_id)
                ended.add(out.request_id)
                for c in out.outputs:
                    assert c.finish_reason in ("stop", "length", "abort", "error"), c
                # Only injected faults may fail a request: hostile parameters are rejected at add.
                assert out.error is None or "injected step fault" in out.error, out.error
                if out.request_id in scored and out.error is None and any(c.token_ids for c in out.outputs):
                    lps = out.prompt_logprobs  # one entry per prompt token, each scored but the first
                    assert len(lps) == len(out.prompt_token_ids) and lps[0] is None
                    assert all(e is not None and out.prompt_token_ids[i] in e for i, e in enumerate(lps) if i)
        for gid in list(engine.beams.outputs):
            out = engine.beams.outputs.pop(gid)
            assert out.error is None or "injected step fault" in out.error, out.error
            ended.add(gid)
        steps += 1
        assert steps < 50 * num_requests, "the engine stopped making progress"
    stats = engine.stats()
    assert accepted <= ended, f"requests that never ended: {sorted(accepted - ended)[:5]}"
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "leaked KV blocks"
    engine.scheduler.kv.check_integrity()
    assert stats["scheduled_tokens"] == stats["forward_tokens"] and stats["ledger_violations"] == 0
    assert stats["step_errors"] == faults["fired"]
    return dict(stats, accepted=len(accepted), rejected=rejected)


@pytest.mark.parametrize("async_scheduling,seed,num_requests", [(False, 0, 1500), (True, 1, 500)])
def test_engine_survives_random_hostile_requests(model_dir, async_scheduling, seed, num_requests):
    s = _fuzz(model_dir, seed, num_requests, async_scheduling)
    # The fuzzer must exercise both sides: many accepted requests, many rejected ones.
    assert s["accepted"] > num_requests // 4 and s["rejected"] > num_requests // 20
    # Injected faults fail their step's requests and nothing else; there were some.
    assert s["step_errors"] >= 1


def test_beam_scoring_error_fails_only_its_group(model_dir, monkeypatch):
    """Beam scoring that raises (as length_penalty=1e308 once did) ends that group with an error;
    the loop and a plain request next to it go on."""
    from tallyserve.engine import beam_search

    engine = LLMEngine(EngineArgs(model=model_dir, num_gpu_blocks_override=64, block_size=4))
    real = beam_search.BeamGroup._add_finished

    def boom(self, cands, ends, width):
        if self.group_id == "bad":
            raise OverflowError("numerical result out of range")
        return real(self, cands, ends, width)

    monkeypatch.setattr(beam_search.BeamGroup, "_add_finished", boom)
    engine.add_beam_search_request("bad", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=4))
    engine.add_beam_search_request("good", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=4))
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    bad, good = engine.beams.outputs.pop("bad"), engine.beams.outputs.pop("good")
    assert bad.sequences == [] and "OverflowError" in bad.error
    assert good.error is None and len(good.sequences) == 2
    assert len(finished["plain"].outputs[0].token_ids) == 6
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_exception_escaping_a_step_fails_that_step_only(model_dir, monkeypatch, async_scheduling):
    """Last-resort guard: an exception outside the per-step isolation (here: in the scheduler's
    update) fails the requests of the steps being handled; later requests run normally."""
    engine = LLMEngine(EngineArgs(model=model_dir, num_gpu_blocks_override=64, block_size=4,
                                  async_scheduling=async_scheduling))
    sched = engine.scheduler
    real = sched.update
    calls = {"n": 0}

    def flaky(so, sampled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("bug in update")
        return real(so, sampled)

    monkeypatch.setattr(sched, "update", flaky)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [3, 4, 5], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["a"].error is not None and "KeyError" in outs["a"].error
    engine.add_request("b", [3, 4, 5], params)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["b"].error is None and len(outs["b"].outputs[0].token_ids) == 5
    s = engine.stats()
    assert s["step_errors"] == 1 and s["num_free_blocks"] == s["num_total_blocks"]


def test_broken_invariant_stops_the_loop_with_a_reason(model_dir, monkeypatch):
    """Only a failed invariant (or a broken device) may end the loop: EngineFatalError says why."""
    from tallyserve.engine.llm_engine import EngineFatalError

    engine = LLMEngine(EngineArgs(model=model_dir, num_gpu_blocks_override=64, block_size=4))
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3))

    def corrupt(*_a, **_k):
        engine.scheduler.kv.pool.blocks[0].ref_cnt = -1
        raise RuntimeError("step went wrong")

    monkeypatch.setattr(engine.scheduler, "update", corrupt)
    with pytest.raises(EngineFatalError, match="invariants"):
        while engine.has_unfinished_requests():
            engine.step()
