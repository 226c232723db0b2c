"""Structured outputs under async scheduling: grammar rows are scheduled while their previous
token is still in flight (the engine core fills their bitmask once that token reached the host,
between the forward pass and the sampling), and the answers are exactly those of synchronous
scheduling, greedy and seeded, with n > 1, a stop string, preemption and a failed step. A grammar
that ends at step N ends its request there: the token already scheduled for step N + 1 is computed
(the ledger holds) but never emitted."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tallyserve import LLM, SamplingParams, StructuredOutputsParams
from tests.model.test_structured_outputs import CHOICES, EBNF, PERSON, PROMPTS, _check_ledger
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("structured_async"), "llama")
    make_tiny_tokenizer(path)
    return path


class StepTrace:
    """What the scheduler planned and when each step's results came back, in order."""

    def __init__(self, llm: LLM) -> None:
        self.events: list[tuple[str, int]] = []  # ("schedule" | "update", step id)
        self.sampled: dict[int, set[str]] = {}  # step id -> ids of the requests it samples
        self.grammar_ids: set[str] = set()
        sched = llm.engine.scheduler
        schedule, update = sched.schedule, sched.update

        def traced_schedule(*args, **kwargs):
            so = schedule(*args, **kwargs)
            if so.requests:
                self.events.append(("schedule", so.step_id))
                self.sampled[so.step_id] = {e.request_id for e in so.requests if e.sample}
                self.grammar_ids |= {e.request_id for e in so.requests
                                     if e.sampling_params.structured_outputs is not None}
            return so

        def traced_update(so, sampled):
            self.events.append(("update", so.step_id))
            return update(so, sampled)

        sched.schedule, sched.update = traced_schedule, traced_update

    def steps_sampling(self, rid: str) -> list[int]:
        return sorted(s for s, ids in self.sampled.items() if rid in ids)

    def overlapped(self, rid: str) -> int:
        """Steps sampling ``rid`` that were scheduled before its previous sampling step's results
        were applied (the request's token was still in flight)."""
        at = {ev: i for i, ev in enumerate(self.events)}
        steps = self.steps_sampling(rid)
        return sum(at[("schedule", b)] < at.get(("update", a), math.inf) for a, b in zip(steps, steps[1:]))


def _json(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), **kw)


def _mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    """Grammar and plain requests in one batch."""
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    params = [_json() if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def _tokens(outs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_grammar_rows_overlap_and_match_sync(model_dir):
    prompts, params = _mixed_batch()
    sync = LLM(model=model_dir, block_size=4, async_scheduling=False)
    want = sync.generate(prompts, params)
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    trace = StepTrace(llm)
    outs = llm.generate(prompts, params)
    assert _tokens(outs) == _tokens(want)
    for o, p in zip(outs, params):
        comp = o.outputs[0]
        assert o.error is None
        if p.structured_outputs is not None:
            assert comp.finish_reason == "stop"
            jsonschema.validate(json.loads(comp.text), PERSON)
    assert len(trace.grammar_ids) == 3
    for rid in trace.grammar_ids:
        decode_steps = len(trace.steps_sampling(rid)) - 1
        assert decode_steps > 5
        # every grammar step after the first was planned while the previous token was in flight
        assert trace.overlapped(rid) == decode_steps, rid
    s = _check_ledger(llm)
    assert s["async_steps"] == s["steps"]


def test_an_executor_that_cannot_split_a_step_keeps_grammar_rows_waiting(model_dir):
    """The fallback (Scheduler.grammar_waits): grammar rows wait for their token; answers are the same."""
    prompts, params = _mixed_batch()
    want = _tokens(LLM(model=model_dir, block_size=4, async_scheduling=False).generate(prompts, params))
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    llm.engine.scheduler.grammar_waits = True
    trace = StepTrace(llm)
    assert _tokens(llm.generate(prompts, params)) == want
    assert all(trace.overlapped(rid) == 0 for rid in trace.grammar_ids)
    plain = set().union(*trace.sampled.values()) - trace.grammar_ids
    assert all(trace.overlapped(rid) > 0 for rid in plain)  # rows without a grammar still overlap
    _check_ledger(llm)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_ending_at_step_n_drops_the_token_scheduled_for_n_plus_1(model_dir, ignore_eos):
    """EOS where the grammar ends (the scheduler stops it) or, with ignore_eos, the matcher's end
    state (the engine stops it): either way step N + 1 already computed a row for the request,
    which is charged and computed (ledger exact) but whose token never reaches the output."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=ignore_eos,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    want = LLM(model=model_dir, block_size=4).generate(PROMPTS, params)
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    trace = StepTrace(llm)
    outs = llm.generate(PROMPTS, params)
    assert _tokens(outs) == _tokens(want)
    for o in outs:
        comp = o.outputs[0]
        assert comp.finish_reason == "stop" and comp.text in CHOICES
        assert comp.token_ids[-1] in llm.engine.eos_token_ids  # the grammar's own end, nothing after it
    for o, rid in zip(outs, sorted(trace.grammar_ids, key=int)):
        assert len(trace.steps_sampling(rid)) == len(o.outputs[0].token_ids) + 1  # the dropped extra row
    _check_ledger(llm)


def test_preemption_under_async_keeps_the_matcher_exact(model_dir):
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    params = _json()
    want = _tokens(LLM(model=model_dir, block_size=4).generate(prompts, params))
    tight = LLM(model=model_dir, block_size=4, num_gpu_blocks_override=24, max_model_len=96, async_scheduling=True)
    trace = StepTrace(tight)
    outs = tight.generate(prompts, params)
    assert _tokens(outs) == want
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert _check_ledger(tight)["preemptions"] > 0
    assert sum(trace.overlapped(rid) for rid in trace.grammar_ids) > 0


def test_stop_string_and_n_under_async(model_dir):
    """A stop string cuts a grammar answer (its matcher was already one token ahead: the step
    after it is dropped); n = 2 seeded samples each follow their own matcher."""
    stop = SamplingParams(temperature=0.0, max_tokens=120, stop=['"age"'],
                          structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    sampled = _json(temperature=1.0, seed=11, n=2)
    prompts, params = PROMPTS + PROMPTS, [stop] * 3 + [sampled] * 3
    want = LLM(model=model_dir, block_size=4).generate(prompts, params)
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    trace = StepTrace(llm)
    outs = llm.generate(prompts, params)
    assert _tokens(outs) == _tokens(want)
    assert [[c.text for c in o.outputs] for o in outs] == [[c.text for c in o.outputs] for o in want]
    for o in outs[:3]:
        comp = o.outputs[0]
        assert comp.finish_reason == "stop" and comp.stop_reason == '"age"'
        assert comp.text.startswith("{") and '"age"' not in comp.text
    for o in outs[3:]:
        assert len(o.outputs) == 2
        for comp in o.outputs:
            jsonschema.validate(json.loads(comp.text), PERSON)
    assert len(trace.grammar_ids) == 9  # 3 plain ids + 3 x 2 children
    assert all(trace.overlapped(rid) > 0 for rid in trace.grammar_ids)
    _check_ledger(llm)


def test_a_failed_step_fails_its_requests_and_the_next_step_still_samples(model_dir):
    """Step N's results fail to arrive while step N + 1 (with the same grammar rows) is already
    launched: N's requests fail, N + 1's rows for them are filled as ended (their tokens dropped),
    the others finish valid, and nothing leaks."""
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True, max_num_seqs=2)  # "2" starts later
    ex = llm.engine.executor
    launch_forward = ex.launch_forward
    state = {"calls": 0}

    class Broken:  # a launched step whose device-to-host copy fails (its device tokens still feed N + 1)
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def result(self):
            raise RuntimeError("injected: the step's tokens never arrived")

    class BreakOnce:
        def __init__(self, pending):
            self.pending = pending

        def sample(self, so):
            handle = self.pending.sample(so)
            return Broken(handle) if {"0", "1"} & {e.request_id for e in so.requests if e.sample} else handle

    def flaky(so, *args, **kwargs):
        pending = launch_forward(so, *args, **kwargs)
        state["calls"] += 1
        return BreakOnce(pending) if state["calls"] == 6 else pending

    ex.launch_forward = flaky
    outs = llm.generate(PROMPTS, _json())
    assert [o.error is not None for o in outs] == [True, True, False]
    assert all("injected" in o.error for o in outs[:2])
    jsonschema.validate(json.loads(outs[2].outputs[0].text), PERSON)
    _check_ledger(llm)
    ex.launch_forward = launch_forward
    again = llm.generate(PROMPTS[:1], _json())[0]  # the engine goes on
    assert again.error is None
    jsonschema.validate(json.loads(again.outputs[0].text), PERSON)
    _check_ledger(llm)


def test_a_failed_bitmask_fill_fails_its_step_and_the_engine_goes_on(model_dir):
    """Filling one step's bitmask raises (its forward pass is already queued): that step's requests fail
    with the error, the engine keeps stepping, later requests are valid, and the ledger and the KV cache
    stay exact."""
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    manager = llm.engine.structured
    bitmask_for, state = manager.bitmask_for, {"calls": 0}

    def flaky(so, requests):
        state["calls"] += 1
        if state["calls"] == 4:
            raise RuntimeError("injected: the fill failed")
        return bitmask_for(so, requests)

    manager.bitmask_for = flaky
    outs = llm.generate(PROMPTS, _json())
    assert all(o.error is not None and "injected: the fill failed" in o.error for o in outs)
    assert not llm.engine.core.has_inflight()
    manager.bitmask_for = bitmask_for
    again = llm.generate(PROMPTS, _json())
    for o in again:
        assert o.error is None
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert _check_ledger(llm)["step_errors"] == 1
    llm.engine.scheduler.check_integrity()


@pytest.fixture(scope="module")
def manager(model_dir):
    """The engine's structured-output manager and a looping grammar compiled by it."""
    m = LLM(model=model_dir, block_size=4).engine.structured
    return m, m.compile(StructuredOutputsParams(grammar=EBNF))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batched_matcher_advance_equals_replaying_each_sequence(manager, data):
    """Whatever happens to the sequences between two steps (one new token each, several, none, or
    tokens cut by a stop string), ``advance`` leaves every matcher where a fresh matcher fed the
    sequence's output tokens would be: same tokens, same next-token bitmask, same end state."""
    import xgrammar as xgr

    from tallyserve.request import Request
    from tallyserve.runner.grammar_mask import allowed_from_bitmask

    m, compiled = manager
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=EBNF))
    reqs = [Request(f"h{i}", [1, 2, 3], params, max_tokens=64, eos_token_ids=m.eos_token_ids) for i in range(5)]
    for r in reqs:
        m.register(r.request_id, compiled, "grammar")

    def replay(r):
        matcher = xgr.GrammarMatcher(compiled)
        for t in r.output_token_ids:
            assert matcher.accept_token(t)
        mask = xgr.allocate_token_bitmask(1, m.vocab_size)
        if not matcher.is_terminated():  # (an ended matcher has no next-token mask)
            matcher.fill_next_token_bitmask(mask, 0)
        return matcher, mask

    try:
        for _ in range(data.draw(st.integers(1, 10))):
            for r in reqs:
                action = data.draw(st.sampled_from(["one", "one", "two", "cut", "none"]))
                if action == "cut" and r.output_token_ids:
                    del r.all_token_ids[-data.draw(st.integers(1, len(r.output_token_ids))):]
                for _ in range({"one": 1, "two": 2}.get(action, 0)):
                    matcher, mask = replay(r)
                    if matcher.is_terminated():
                        break
                    allowed = allowed_from_bitmask(mask, m.vocab_size)[0].nonzero().flatten().tolist()
                    r.all_token_ids.append(data.draw(st.sampled_from(allowed)))
            m.advance(reqs)
            for r in reqs:
                state = m.states[r.request_id]
                assert state.error is None and state.tokens == r.output_token_ids
                want_matcher, want = replay(r)
                got = xgr.allocate_token_bitmask(1, m.vocab_size)
                if not want_matcher.is_terminated():
                    state.matcher.fill_next_token_bitmask(got, 0)
                    assert torch.equal(got, want)
                assert state.matcher.is_terminated() == want_matcher.is_terminated() == state.ended
    finally:
        for r in reqs:
            m.forget(r.request_id)
