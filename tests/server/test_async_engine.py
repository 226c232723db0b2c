"""AsyncLLMEngine in-process (no HTTP): streams equal the offline engine, closing a stream aborts
its request and frees its blocks, a dead loop fails everything pending, the queue limit holds; beam
search groups obey the same rules.

No test here judges wall-clock time: a step the test needs long is held on an event until the test
has seen what it checks, the stall window of the queue rule is crossed on the engine's own clock (the
test moves it), and every wait is bounded by TIMEOUT_S, failing only on a hang."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tallyserve import LLM, SamplingParams
from tallyserve.config import EngineArgs
import tallyserve.engine.async_engine as async_engine_module
from tallyserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, FaultKind, QueueFullError,
                                            RequestRejectedError, StepFailedError)
from tallyserve.engine.beam_search import BeamSearchParams
from tallyserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Hello, world!", "Once upon a time"]
BEAM = BeamSearchParams(beam_width=3, max_tokens=6)
LONG_BEAM = BeamSearchParams(beam_width=2, max_tokens=120, ignore_eos=True)  # fits the 64-block cache
TIMEOUT_S = 30


def _engine(model_dir: str, **kwargs) -> AsyncLLMEngine:
    eng = AsyncLLMEngine(LLMEngine(EngineArgs(model=model_dir, num_gpu_blocks_override=64, block_size=8)), **kwargs)
    eng.start()
    return eng


async def _final(eng: AsyncLLMEngine, rid: str, prompt, params=GREEDY):
    last = None
    async for out in eng.generate(rid, prompt, params):
        last = out
    return last


def _hold_next_step(eng: AsyncLLMEngine) -> threading.Event:
    """The engine's next step is scheduled as usual, then waits before its forward pass until the returned event is
    set (at most TIMEOUT_S): a step exactly as long as the test needs, ended once it has seen what it waits for."""
    release = threading.Event()

    def hold(_so) -> None:
        eng.core.engine.fault_injector = None
        release.wait(TIMEOUT_S)

    eng.core.engine.fault_injector = hold
    return release


class _Clock:
    """The engine module's ``time``, with a monotonic clock the test stops and moves (everything else is ``time``'s)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


async def _until(cond, what: str) -> None:
    """Poll `cond` until it holds; bounded by TIMEOUT_S (fails only on a hang)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _wait_idle(eng: AsyncLLMEngine) -> dict:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            break
        await asyncio.sleep(0.05)
    return eng.stats()


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, num_gpu_blocks_override=64, block_size=8)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]


def test_concurrent_streams_match_offline_engine(tiny_model_dir, references):
    eng = _engine(tiny_model_dir)

    async def run():
        return await asyncio.gather(*(_final(eng, f"r{i}", p) for i, p in enumerate(PROMPTS)))

    try:
        outs = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
        assert [o.outputs[0].text for o in outs] == references
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
        health = eng.health()
        assert health.healthy and health.pending == 0
    finally:
        eng.shutdown()


def test_closing_a_stream_aborts_and_frees_blocks(tiny_model_dir):
    eng = _engine(tiny_model_dir)

    async def run():
        gen = eng.generate("long", PROMPTS[0], LONG)
        first = await gen.__anext__()
        await gen.aclose()  # what a client disconnect does
        return first, await _wait_idle(eng)

    try:
        first, stats = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
        assert not first.finished
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert eng.health().pending == 0
    finally:
        eng.shutdown()


def test_rejections_and_step_failure(tiny_model_dir):
    eng = _engine(tiny_model_dir)

    async def run():
        with pytest.raises(RequestRejectedError):
            await _final(eng, "bad", {"prompt_token_ids": [10**6]})
        eng.inject_fault(FaultKind.STEP_EXCEPTION)
        with pytest.raises(StepFailedError):
            await _final(eng, "fails", PROMPTS[0])
        return await _final(eng, "ok", PROMPTS[0])

    try:
        ok = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
        assert ok.outputs[0].finish_reason == "length"
        assert eng.is_running
    finally:
        eng.shutdown()


def test_queue_limit(tiny_model_dir, monkeypatch):
    """max_queue_len caps requests waiting in the scheduler; requests the loop has not picked up
    count only once they have sat in its inbox for the stall window (so a stuck loop fills up)."""
    eng = _engine(tiny_model_dir, max_queue_len=2, stall_timeout=0.5)
    clock = _Clock()
    monkeypatch.setattr(async_engine_module, "time", clock)  # the engine's clock stands still unless moved
    release = _hold_next_step(eng)

    async def run():
        first = asyncio.create_task(_final(eng, "a", PROMPTS[0]))
        # "a" is in its first (held) step; the loop picks up nothing now
        await _until(lambda: eng.health().step_running_s is not None, "the held step")
        queued = [asyncio.create_task(_final(eng, rid, p)) for rid, p in (("b", PROMPTS[1]), ("c", PROMPTS[2]))]
        await _until(lambda: eng.health().pending == 3, "b and c in the inbox")
        assert eng.num_waiting() == 0  # just submitted: the loop may yet pick them up
        clock.now += eng.stall_timeout + 0.01
        assert eng.num_waiting() == 2  # in the inbox for longer than the stall window
        with pytest.raises(QueueFullError):
            await _final(eng, "d", PROMPTS[2])
        release.set()
        return await asyncio.gather(first, *queued)

    try:
        outs = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
        assert all(o.finished for o in outs) and [o.request_id for o in outs] == ["a", "b", "c"]
    finally:
        release.set()
        eng.shutdown()


def test_dead_loop_fails_pending_and_refuses_new(tiny_model_dir):
    eng = _engine(tiny_model_dir, stall_timeout=1.0)

    async def stream(rid, prompt, started):
        last = None
        async for out in eng.generate(rid, prompt, LONG):
            last = out
            started.set()
        return last

    async def run():
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(stream(f"p{i}", p, ev)) for i, (p, ev) in enumerate(zip(PROMPTS, started))]
        # kill the loop once every request is generating (a fixed wait let fast steps finish all 400 tokens)
        await asyncio.gather(*(ev.wait() for ev in started))
        eng.inject_fault(FaultKind.KILL_LOOP)
        # bounded: the streams fail when the loop dies (all 400 tokens would take many steps, and end normally)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert all(isinstance(r, EngineDeadError) and "killed" in str(r) for r in results), results
    health = eng.health()
    assert not health.alive and not health.healthy and "killed" in health.reason
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(_final(eng, "late", PROMPTS[0]), TIMEOUT_S))
    with pytest.raises(EngineDeadError):
        eng.inject_fault(FaultKind.STALL, 1.0)
    eng.shutdown()


async def _until_running(eng: AsyncLLMEngine) -> None:
    await _until(lambda: eng.stats()["num_running"] > 0, "a request running")


def test_beam_search_matches_offline_and_fails_like_generate(tiny_model_dir, monkeypatch):
    ref = LLM(model=tiny_model_dir, num_gpu_blocks_override=64, block_size=8).beam_search(PROMPTS[0], BEAM)[0]
    eng = _engine(tiny_model_dir, max_queue_len=2, stall_timeout=1.0)
    clock = _Clock()

    async def run():
        out = await eng.beam_search("b", PROMPTS[0], BEAM)
        with pytest.raises(RequestRejectedError):
            await eng.beam_search("bad", {"prompt_token_ids": [10**6]}, BEAM)
        eng.inject_fault(FaultKind.STEP_EXCEPTION)
        with pytest.raises(StepFailedError):
            await eng.beam_search("fails", PROMPTS[0], BEAM)
        release = _hold_next_step(eng)
        monkeypatch.setattr(async_engine_module, "time", clock)  # the engine's clock stands still unless moved
        clock.now = time.monotonic()
        try:
            first = asyncio.create_task(eng.beam_search("q1", PROMPTS[1], BEAM))
            # in its first (held) step: the loop picks up nothing now
            await _until(lambda: eng.health().step_running_s is not None, "the held step")
            queued = [asyncio.create_task(eng.beam_search(rid, PROMPTS[2], BEAM)) for rid in ("q2", "q3")]
            await _until(lambda: eng.health().pending == 3, "q2 and q3 in the inbox")
            assert eng.num_waiting() == 0  # just submitted: not counted yet
            clock.now += eng.stall_timeout + 0.01  # in the inbox for longer than the stall window: they count
            assert eng.num_waiting() == 2
            with pytest.raises(QueueFullError):
                await eng.beam_search("over", PROMPTS[2], BEAM)
        finally:
            release.set()
            monkeypatch.setattr(async_engine_module, "time", time)
        await asyncio.gather(first, *queued)
        cancelled = asyncio.create_task(eng.beam_search("gone", PROMPTS[0], LONG_BEAM))
        await _until_running(eng)
        cancelled.cancel()  # what a client disconnect does
        await asyncio.gather(cancelled, return_exceptions=True)
        idle = await _wait_idle(eng)
        pending = asyncio.create_task(eng.beam_search("pending", PROMPTS[1], LONG_BEAM))
        await _until_running(eng)
        eng.inject_fault(FaultKind.KILL_LOOP)
        dead = (await asyncio.gather(pending, return_exceptions=True))[0]  # bounded: fails when the loop dies
        return out, idle, dead

    out, idle, dead = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
    assert [s.text for s in out.sequences] == [s.text for s in ref.sequences]
    assert idle["num_free_blocks"] == idle["num_total_blocks"] and idle["num_running"] == 0
    assert isinstance(dead, EngineDeadError) and "killed" in str(dead), dead
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(eng.beam_search("late", PROMPTS[0], BEAM), TIMEOUT_S))
    eng.shutdown()


def test_a_request_that_breaks_admission_fails_alone(tiny_model_dir, monkeypatch):
    """An unexpected exception while adding one request (not a ValueError) ends that request with an
    error; the loop lives on and serves the next request."""
    eng = _engine(tiny_model_dir)
    real = eng.core.engine.add_core_request

    def flaky(request):
        if request.request_id == "bad":
            raise TypeError("unexpected type deep in the engine")
        return real(request)

    monkeypatch.setattr(eng.core.engine, "add_core_request", flaky)

    async def run(rid):
        outs = [o async for o in eng.generate(rid, {"prompt_token_ids": [5, 6, 7]},
                                              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))]
        return outs[-1]

    try:
        with pytest.raises(StepFailedError, match="TypeError"):
            asyncio.run(run("bad"))
        assert eng.is_running and eng.health().healthy
        assert len(asyncio.run(run("good")).outputs[0].token_ids) == 3
    finally:
        eng.shutdown()
