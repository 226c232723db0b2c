"""Honest health: a step that runs long but within its predicted time (seconds per scheduled token,
learned from finished steps, times the tokens it scheduled) is progress, not a stall, even past the
stall timeout; a step far beyond its prediction, a loop stuck outside a step with work pending and a
dead loop are unhealthy. Live: /health stays 200 through a multi-second prefill with
--stall-timeout 1."""

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
from tests.server.test_async_engine import GREEDY, PROMPTS, TIMEOUT_S, _engine, _final
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

STALL_TIMEOUT_S = 0.5


def _poll_health(eng: AsyncLLMEngine, task: asyncio.Task, interval: float = 0.05):
    """Health samples every `interval` seconds until `task` is done."""
    async def run():
        samples = []
        while not task.done():
            samples.append(eng.health())
            await asyncio.sleep(interval)
        await task
        return samples
    return run()


def _trained(tiny_model_dir: str) -> AsyncLLMEngine:
    """An engine whose seconds-per-token estimate comes from real steps."""
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    asyncio.run(asyncio.wait_for(_final(eng, "warm", PROMPTS[0], GREEDY), TIMEOUT_S))
    return eng


def _stalled_step_samples(eng: AsyncLLMEngine, prompt, seconds: float, params=GREEDY) -> list:
    """Health samples while a request runs whose first step (scheduled as usual, then held for
    `seconds` by the stall fault) takes that much longer."""
    eng.inject_fault(FaultKind.STALL, seconds)

    async def run():
        return await _poll_health(eng, asyncio.create_task(_final(eng, "r", prompt, params)))

    return asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


def test_long_step_within_its_prediction_stays_healthy(tiny_model_dir):
    """A 480-token prefill step held for 1.2 s (over twice the stall timeout), within its limit of
    stall timeout + 8x the time predicted for 480 tokens at the measured speed."""
    eng = _trained(tiny_model_dir)
    spt, n, hold = eng.health().seconds_per_token, 480, 1.2
    limit = STALL_TIMEOUT_S + STALL_FACTOR * spt * n
    assert limit > hold + 0.5, f"{spt * 1e3:.3f} ms/token: this machine is too fast for the test"
    try:
        samples = _stalled_step_samples(eng, {"prompt_token_ids": [(7 * i) % 240 + 3 for i in range(n)]}, hold)
    finally:
        eng.shutdown()
    in_step = [h for h in samples if h.step_running_s is not None and h.step_tokens == n]
    assert max(h.step_running_s for h in in_step) > 2 * STALL_TIMEOUT_S  # well past the stall timeout
    assert max(h.seconds_since_heartbeat for h in samples) > 2 * STALL_TIMEOUT_S  # the old rule: "stalled"
    assert all(h.step_limit_s == pytest.approx(limit) for h in in_step)
    unhealthy = [h.reason for h in samples if not h.healthy]
    assert not unhealthy, unhealthy[:1]


def test_step_far_beyond_its_prediction_is_stalled(tiny_model_dir):
    """A one-token step held for a second past its limit (stall timeout + 8x its prediction at the
    measured speed): stalled from its limit on, with the numbers in the reason; healthy after."""
    eng = _trained(tiny_model_dir)
    spt = eng.health().seconds_per_token
    limit = STALL_TIMEOUT_S + STALL_FACTOR * spt
    try:
        samples = _stalled_step_samples(eng, {"prompt_token_ids": [42]}, limit + 1.0,
                                        SamplingParams(max_tokens=1, temperature=0.0))
        after = eng.health()
    finally:
        eng.shutdown()
    stalled = [h for h in samples if not h.healthy]
    assert stalled, f"never unhealthy: {spt=} {samples[len(samples) // 2]}"
    first = stalled[0]
    assert first.step_tokens == 1 and first.step_limit_s == pytest.approx(limit)
    assert limit < first.step_running_s < limit + 0.5  # detected soon after its limit, not before
    assert all(h.step_running_s is not None and h.step_running_s > limit for h in stalled)
    assert "stalled" in first.reason and "for 1 token(s)" in first.reason
    assert f"{spt * 1e3:.3f} ms/token" in first.reason and f"limit of {limit:.1f}s" in first.reason
    assert after.healthy  # the step ended: progress again
    assert after.seconds_per_token <= 1.6 * spt * (1 + 1e-9)  # one stalled step moves the estimate little


def test_loop_stuck_outside_a_step_is_stalled(tiny_model_dir):
    """Work pending, no step running, none completed for the stall window: stalled."""
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    real = eng.core.engine.add_core_request

    def slow_add(*args, **kwargs):
        eng.core.engine.add_core_request = real
        time.sleep(1.5)
        return real(*args, **kwargs)

    eng.core.engine.add_core_request = slow_add

    async def run():
        return await _poll_health(eng, asyncio.create_task(_final(eng, "r", PROMPTS[0], GREEDY)))

    try:
        samples = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    finally:
        eng.shutdown()
    stalled = [h for h in samples if not h.healthy]
    assert stalled and all(h.step_running_s is None and h.pending == 1 for h in stalled)
    assert stalled[0].seconds_since_heartbeat < STALL_TIMEOUT_S + 0.5
    assert "no step running" in stalled[0].reason


def test_dead_loop_is_unhealthy(tiny_model_dir):
    eng = _engine(tiny_model_dir, stall_timeout=STALL_TIMEOUT_S)
    eng.inject_fault(FaultKind.KILL_LOOP)
    deadline = time.monotonic() + 5
    while eng.health().alive and time.monotonic() < deadline:
        time.sleep(0.01)
    health = eng.health()
    assert not health.alive and not health.healthy and "not running" in health.reason
    eng.shutdown()


# ----------------------------------------------------------------------------- live server

PREFILL_TOKENS = 4000


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory) -> str:
    """A wider, deeper tiny Llama: a 4,000-token prefill takes about a second on CPU."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-wide"), "llama", seed=0, max_position_embeddings=4096,
                           hidden_size=256, intermediate_size=1024, num_hidden_layers=12)
    make_tiny_tokenizer(path)
    return path


def test_health_stays_ok_through_a_long_prefill(slow_model_dir, server_logs):
    """--stall-timeout 0.25 and one prefill step of 4,000 tokens that takes about a second: /health answers
    200 throughout, while the time since the last finished step grows past three stall timeouts."""
    srv = LiveServer(slow_model_dir, server_logs, "--served-model-name", MODEL, "--stall-timeout", "0.25",
                     "--max-num-batched-tokens", str(PREFILL_TOKENS + 96), "--num-gpu-blocks-override", "600")
    try:
        url = srv.base_url
        short = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=short, timeout=30).status_code == 200
        prompt = [(7 * i) % 240 + 3 for i in range(PREFILL_TOKENS)]
        result: dict = {}

        def long_request() -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            result["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        worker = threading.Thread(target=long_request)
        worker.start()
        samples = []
        while worker.is_alive():
            r = httpx.get(url + "/health", timeout=5)
            samples.append((r.status_code, r.json()))
            time.sleep(0.1)
        worker.join()
    finally:
        srv.stop()
    assert result["response"].status_code == 200
    longest = max(body["seconds_since_last_step"] for _, body in samples)
    print(f"longest time since the last step while polled: {longest}s over {len(samples)} probes")
    assert longest > 0.75, f"the prefill step took only {longest}s: too fast to test the stall rule"
    bad = [(code, body) for code, body in samples if code != 200]
    assert not bad, bad[:1]
