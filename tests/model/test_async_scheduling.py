"""Async scheduling through the whole engine on a tiny model: the step after a stop is charged
and computed exactly once, streamed outputs never show an unsampled token, and beam search
(which runs synchronously) can share an async engine."""

from __future__ import annotations

import pytest

from tallyserve import LLM, SamplingParams
from tallyserve.engine.beam_search import BeamSearchParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

PROMPT = {"prompt_token_ids": [12, 200, 31, 9, 77, 140, 66, 21]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("async"), "llama")
    make_tiny_tokenizer(path)
    return path


def _stats(llm):
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    return s


def test_stop_token_costs_exactly_one_extra_row(model_dir):
    free_run = LLM(model=model_dir, async_scheduling=False).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    toks = free_run.outputs[0].token_ids
    sync, asyn = (LLM(model=model_dir, block_size=4, async_scheduling=a) for a in (False, True))
    cut = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[toks[cut]])
    outs = [llm.generate(PROMPT, params)[0].outputs[0] for llm in (sync, asyn)]
    for out in outs:
        assert out.token_ids == toks[: cut + 1] and out.finish_reason == "stop" and out.stop_reason == toks[cut]
    s_sync, s_async = _stats(sync), _stats(asyn)
    # the step after the stop token was already running when the stop was seen: one row, charged
    assert s_sync["scheduled_tokens"] == len(PROMPT["prompt_token_ids"]) + cut
    assert s_async["scheduled_tokens"] == s_sync["scheduled_tokens"] + 1
    assert s_async["async_steps"] == s_async["steps"] > 0


def test_streamed_outputs_never_show_placeholders(model_dir):
    llm = LLM(model=model_dir, block_size=4, max_num_batched_tokens=8, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=1)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [3 + i] * (4 + 5 * i)}, params)
    seen: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert all(t >= 0 for t in ids) and len(out.outputs[0].logprobs) == len(ids)
            seen.setdefault(out.request_id, []).append(list(ids))
    want = LLM(model=model_dir, block_size=4, async_scheduling=False).generate(
        [{"prompt_token_ids": [3 + i] * (4 + 5 * i)} for i in range(3)], params)
    for i, ref in enumerate(want):
        snaps = seen[str(i)]
        assert snaps[-1] == ref.outputs[0].token_ids
        assert all(a == b[: len(a)] for a, b in zip(snaps, snaps[1:]))  # each snapshot extends the last
    _stats(llm)


def test_beam_search_on_an_async_engine(model_dir):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sync, asyn = (LLM(model=model_dir, block_size=4, async_scheduling=a) for a in (False, True))
    for llm in (sync, asyn):
        first = llm.generate(PROMPT, plain)[0].outputs[0].token_ids
        beams = llm.beam_search([PROMPT], params)[0]
        again = llm.generate(PROMPT, plain)[0].outputs[0].token_ids
        assert first == again
        llm.result = ([s.tokens for s in beams.sequences], first)
    assert asyn.result == sync.result
    s = _stats(asyn)
    assert 0 < s["async_steps"] < s["steps"]  # plain requests overlapped, beam steps did not


def test_reusing_an_aborted_id_while_its_step_is_in_flight(model_dir):
    llm = LLM(model=model_dir, block_size=4, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3, 4, 5]}, params)
    engine.step()
    engine.step()  # the old "a" has a step in flight
    engine.abort_request("a")
    engine.add_request("a", {"prompt_token_ids": [9, 8, 7]}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    ref = LLM(model=model_dir, block_size=4, async_scheduling=False).generate({"prompt_token_ids": [9, 8, 7]}, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "length"]
    assert outs[1].outputs[0].token_ids == ref[0].outputs[0].token_ids
    _stats(llm)


def test_a_failed_step_after_a_stop_leaves_the_stop_alone(model_dir):
    """The step after a stop token already holds the stopped request's row; if that step fails, the
    request still ends "stop" with its stop token, as without async scheduling."""
    free = LLM(model=model_dir, async_scheduling=False).generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    cut = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free[cut]])
    results = []
    for async_sched in (False, True):
        llm = LLM(model=model_dir, block_size=4, async_scheduling=async_sched)
        steps = []

        def fault(so, steps=steps):
            steps.append(so.step_id)
            if len(steps) == cut + 2:  # the step after the one that samples the stop token
                raise RuntimeError("device fault")

        llm.engine.fault_injector = fault
        out = llm.generate(PROMPT, params)[0]
        results.append((out.outputs[0].token_ids, out.outputs[0].finish_reason, out.error))
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    assert results[0] == results[1] == (free[: cut + 1], "stop", None)
