"""Honest health: a step that runs long but within its predicted time (seconds per scheduled token,
learned from finished steps, times the tokens it scheduled) is progress, not a stall, even past the
stall timeout; a step far beyond its prediction, a loop stuck outside a step with work pending and a
dead loop are unhealthy. Live: /health stays 200 through a long prefill step with --stall-timeout 0.25.

The long steps are held by the test (an event, or the stall fault on a live server) until it has observed
what it checks, so neither a slow nor a fast machine changes what is tested; waits are bounded (TIMEOUT_S)
and fail only on a hang."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tallyserve import SamplingParams
from tallyserve.engine.async_engine import AsyncLLMEngine, FaultKind
from tallyserve.engine.health import STALL_FACTOR
from tests.server.live_server import MODEL, LiveServer
from tests.server.test_async_engine import GREEDY, PROMPTS, TIMEOUT_S, _engine, _final, _hold_next_step

STALL_TIMEOUT_S = 0.5
MIN_STEP_S = 0.02  # each training step is held this long: a floor under the learned seconds per token


def _samples_until(eng: AsyncLLMEngine, request, release: threading.Event, seen) -> list:
    """Health samples every 20 ms while `request` (a coroutine) runs; `release` is set once ``seen(samples)`` is
    true, so whatever holds the loop lets go only after the state under test was observed. Bounded: TIMEOUT_S."""
    async def run():
        task = asyncio.create_task(request)
        samples = []
        while not task.done():
            samples.append(eng.health())
            if not release.is_set() and seen(samples):
                release.set()
            await asyncio.sleep(0.02)
        await task
        return samples

    try:
        return asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        release.set()


def _trained(tiny_model_dir: str) -> AsyncLLMEngine:
    """An engine whose seconds-per-token estimate comes from real steps, each held at least MIN_STEP_S before its
    forward pass: the estimate then has a floor (about MIN_STEP_S per decode token) whatever this machine's
    speed, so a prediction the tests rely on cannot shrink below their margins on a fast machine."""
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    eng.core.engine.fault_injector = lambda _so: time.sleep(MIN_STEP_S)
    try:
        asyncio.run(asyncio.wait_for(_final(eng, "warm", PROMPTS[0], GREEDY), TIMEOUT_S))
    finally:
        eng.core.engine.fault_injector = None
    return eng


def test_long_step_within_its_prediction_stays_healthy(tiny_model_dir):
    """A 480-token prefill step held until it has run over twice the stall timeout (and the time since the last
    finished step, the old rule's measure, is past it too), well within its limit of stall timeout + 8x the time
    predicted for 480 tokens at the measured speed: healthy throughout."""
    eng = _trained(tiny_model_dir)
    spt, n = eng.health().seconds_per_token, 480
    limit = STALL_TIMEOUT_S + STALL_FACTOR * spt * n
    # the training's floor makes this about a minute on any machine (the hold below ends after about 1 s)
    assert limit > 20 * STALL_TIMEOUT_S, f"{spt * 1e3:.3f} ms/token despite {MIN_STEP_S}s training steps"
    release = _hold_next_step(eng)
    prompt = {"prompt_token_ids": [(7 * i) % 240 + 3 for i in range(n)]}
    try:
        samples = _samples_until(eng, _final(eng, "r", prompt), release, lambda got: (
            got[-1].step_running_s is not None and got[-1].step_running_s > 2 * STALL_TIMEOUT_S
            and got[-1].seconds_since_heartbeat > 2 * STALL_TIMEOUT_S))
    finally:
        eng.shutdown()
    in_step = [h for h in samples if h.step_running_s is not None and h.step_tokens == n]
    assert max(h.step_running_s for h in in_step) > 2 * STALL_TIMEOUT_S  # well past the stall timeout
    assert max(h.seconds_since_heartbeat for h in samples) > 2 * STALL_TIMEOUT_S  # the old rule: "stalled"
    assert in_step[0].step_limit_s == pytest.approx(limit)  # the limit health judged the held step by
    unhealthy = [h.reason for h in samples if not h.healthy]
    assert not unhealthy, unhealthy[:1]


def test_step_far_beyond_its_prediction_is_stalled(tiny_model_dir):
    """A one-token step held past its limit (stall timeout + 8x its prediction at the measured speed) until health
    has said so three times: stalled from its limit on, with the numbers in the reason; healthy after."""
    eng = _trained(tiny_model_dir)
    spt = eng.health().seconds_per_token
    limit = STALL_TIMEOUT_S + STALL_FACTOR * spt
    release = _hold_next_step(eng)
    try:
        samples = _samples_until(eng, _final(eng, "r", {"prompt_token_ids": [42]},
                                             SamplingParams(max_tokens=1, temperature=0.0)),
                                 release, lambda got: sum(not h.healthy for h in got) >= 3)
        after = eng.health()
    finally:
        eng.shutdown()
    stalled = [h for h in samples if not h.healthy]
    assert len(stalled) >= 3, f"never unhealthy: {spt=} {samples[len(samples) // 2]}"
    first = stalled[0]
    assert first.step_tokens == 1 and first.step_limit_s == pytest.approx(limit)
    assert all(h.step_running_s is not None and h.step_running_s > limit for h in stalled)
    # the step ran healthy up to its limit: nothing was called stalled before it
    assert all(h.healthy for h in samples if h.step_running_s is not None and h.step_running_s <= limit)
    assert "stalled" in first.reason and "for 1 token(s)" in first.reason
    assert f"{spt * 1e3:.3f} ms/token" in first.reason and f"limit of {limit:.1f}s" in first.reason
    assert after.healthy  # the step ended: progress again
    assert after.seconds_per_token <= 1.6 * spt * (1 + 1e-9)  # one stalled step moves the estimate little


def test_loop_stuck_outside_a_step_is_stalled(tiny_model_dir):
    """Work pending, no step running, none completed for the stall window (the loop is stuck adding the request):
    stalled, until the loop moves again."""
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    real = eng.core.engine.add_core_request
    release = threading.Event()

    def held_add(*args, **kwargs):
        eng.core.engine.add_core_request = real
        release.wait(TIMEOUT_S)
        return real(*args, **kwargs)

    eng.core.engine.add_core_request = held_add
    try:
        samples = _samples_until(eng, _final(eng, "r", PROMPTS[0], GREEDY), release,
                                 lambda got: sum(not h.healthy for h in got) >= 3)
        after = eng.health()
    finally:
        eng.shutdown()
    stalled = [h for h in samples if not h.healthy]
    assert len(stalled) >= 3 and all(h.step_running_s is None and h.pending == 1 for h in stalled)
    assert all(h.seconds_since_heartbeat > STALL_TIMEOUT_S for h in stalled)
    assert "no step running" in stalled[0].reason
    assert after.healthy and after.pending == 0


def test_dead_loop_is_unhealthy(tiny_model_dir):
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    eng.inject_fault(FaultKind.KILL_LOOP)
    deadline = time.monotonic() + TIMEOUT_S  # bounded: fails only if the loop never ends
    while eng.health().alive and time.monotonic() < deadline:
        time.sleep(0.01)
    health = eng.health()
    assert not health.alive and not health.healthy and "not running" in health.reason
    eng.shutdown()


# ----------------------------------------------------------------------------- live server

PREFILL_TOKENS = 400
HOLD_S = 1.5  # the long prefill's step: held this long by the stall fault, past three stall timeouts of 0.25 s


def test_health_stays_ok_through_a_long_prefill(tiny_model_dir, server_logs):
    """--stall-timeout 0.25 and one prefill step of 400 tokens that runs for HOLD_S (the stall fault holds it, so it
    is long on any machine): /health answers 200 throughout, while the time since the last finished step grows past
    three stall timeouts. The step's limit is stall timeout + 8x the time predicted for 400 tokens, many seconds."""
    srv = LiveServer(tiny_model_dir, server_logs, "--served-model-name", MODEL, "--stall-timeout", "0.25",
                     "--enable-fault-injection")
    try:
        url = srv.base_url
        short = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=short, timeout=30).status_code == 200
        assert httpx.post(url + "/debug/fault", json={"kind": "stall", "seconds": HOLD_S}, timeout=10).status_code == 200
        prompt = [(7 * i) % 240 + 3 for i in range(PREFILL_TOKENS)]
        result: dict = {}

        def long_request() -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            result["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        worker = threading.Thread(target=long_request)
        worker.start()
        samples = []
        while worker.is_alive():
            r = httpx.get(url + "/health", timeout=30)
            samples.append((r.status_code, r.json()))
            time.sleep(0.05)
        worker.join()
    finally:
        srv.stop()
    assert result["response"].status_code == 200
    longest = max(body["seconds_since_last_step"] for _, body in samples)
    print(f"longest time since the last step while polled: {longest}s over {len(samples)} probes")
    assert longest > 3 * 0.25, f"no probe landed in the held step: {samples}"
    bad = [(code, body) for code, body in samples if code != 200]
    assert not bad, bad[:1]
