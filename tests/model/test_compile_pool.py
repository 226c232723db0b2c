"""The grammar-compile pool: compiles in worker processes that a deadline or the last waiter's
departure kills, a bounded queue, a bounded cache, and a compile after a kill that still works."""

from __future__ import annotations

import time

import pytest

from tallyserve.sampling_params import StructuredOutputsParams
from tallyserve.structured_output.compile_pool import (CompileCancelledError, CompileJob, CompilePool,
                                                       CompileQueueFullError)
from tallyserve.structured_output.compiler import GrammarCompileCache, GrammarKey
from tallyserve.structured_output.limits import StructuredOutputsLimits
from tallyserve.structured_output.manager import StructuredOutputManager
from tallyserve.tokenizer import load_tokenizer
from tests.tiny_tokenizer import make_tiny_tokenizer

# 20,000 enum values compile for about a minute even with a 256-token vocabulary
SLOW = StructuredOutputsParams(json={"type": "string", "enum": [f"value number {i} xx" for i in range(20_000)]})
CHEAP = StructuredOutputsParams(regex="[a-c]{1,3}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(make_tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _manager(tokenizer, timeout: float = 60.0) -> StructuredOutputManager:
    limits = StructuredOutputsLimits(timeout, 10 ** 7, 10 ** 6, 10 ** 6)
    return StructuredOutputManager(tokenizer, 256, [tokenizer.hf.eos_token_id], limits=limits)


def _until(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_compile_past_its_deadline_is_a_value_error_and_the_next_one_works(tokenizer):
    m = _manager(tokenizer, timeout=1.0)
    m.compile(CHEAP)  # the worker is up
    # (SLOW compiles for about a minute: an error at all, naming the deadline, is the deadline at work)
    with pytest.raises(ValueError, match=r"structured_outputs.json did not compile within 1 s "
                                         r"\(--structured-outputs-compile-timeout\)"):
        m.compile(SLOW)
    assert m.stats.timeouts == 1 and m.stats.failures == 1
    assert m.compile(StructuredOutputsParams(regex="[d-f]+")) is not None  # a new worker took over
    with pytest.raises(ValueError, match="did not compile within"):  # the failure is cached: no second minute
        m.compile(SLOW)
    assert m.stats.timeouts == 1


def test_the_last_waiter_leaving_kills_the_compile(tokenizer):
    m = _manager(tokenizer)
    pool = m.cache.pool
    first, second = m.submit(SLOW), m.submit(SLOW)
    assert first.future is second.future and m.stats.cache_hits == 1
    assert _until(lambda: pool.running() == 1)
    m.release(first)  # one waiter is left: the compile goes on
    assert not _until(lambda: pool.running() == 0 or first.future.done(), 0.3)  # and it is not cancelled meanwhile
    assert pool.running() == 1 and not first.future.done()
    m.release(second)
    with pytest.raises(CompileCancelledError):
        second.future.result(5)
    assert _until(lambda: pool.running() == 0, 5)
    assert m.stats.cancelled == 1
    assert m.compile(CHEAP) is not None
    third = m.submit(SLOW)  # a cancelled compile is not cached: a new waiter starts it again
    assert third.future is not first.future
    m.release(third)


def test_shutdown_cancels_this_engines_compiles(tokenizer):
    m = _manager(tokenizer)
    ticket = m.submit(SLOW)
    m.shutdown()
    with pytest.raises(CompileCancelledError):  # at once, not after the minute SLOW compiles for
        ticket.future.result(10)


def test_the_queue_is_bounded():
    pool = CompilePool(max_workers=0, max_queued=2)  # no worker: every job stays queued
    jobs = [CompileJob("k", lambda: "", "regex", "a", False, 1.0, lambda text: text) for _ in range(4)]
    pool.submit(jobs[0])
    pool.submit(jobs[1])
    with pytest.raises(CompileQueueFullError):
        pool.submit(jobs[2])
    assert pool.queue_depth() == 2
    pool.cancel(jobs[0])
    pool.submit(jobs[3])
    with pytest.raises(CompileCancelledError):
        jobs[0].future.result(1)
    pool.close()
    for job in (jobs[1], jobs[3]):
        with pytest.raises(CompileCancelledError):
            job.future.result(1)


def test_the_cache_keeps_a_bounded_number_of_bytes(tokenizer):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=256)
    cache = GrammarCompileCache(info, max_bytes=1)  # every finished grammar but the newest is evicted
    for i in range(3):
        cache.compile(GrammarKey.of(StructuredOutputsParams(regex=f"x{{{i + 1}}}")))
    assert len(cache) == 1
