"""Async scheduling, step by step: step N+1 is scheduled before step N's token is known. Exact
placeholders, block ids, cached blocks and stops (the property test covers random workloads)."""

from __future__ import annotations

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import PLACEHOLDER_TOKEN_ID as PH
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams


def _sched(num_blocks=16, block_size=4, budget=64, max_len=64, prefix=True):
    return Scheduler(SchedulerConfig(budget, 8, max_len, True), CacheConfig(block_size, num_blocks, prefix, False))


def _req(rid, prompt, max_tokens=8, eos=()):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens=max_tokens,
                   eos_token_ids=eos)


def _entry(so, rid):
    return next(e for e in so.requests if e.request_id == rid)


def test_placeholder_lifecycle():
    s = _sched()
    r = _req("a", [5, 6, 7, 8, 9, 10, 11])
    s.add_request(r)
    so1 = s.schedule(async_scheduling=True)
    assert _entry(so1, "a").token_ids == (5, 6, 7, 8, 9, 10, 11) and so1.async_scheduled
    # advanced at schedule time: the prompt counts as computed, a placeholder waits for its token
    assert r.num_computed_tokens == 7 and r.all_token_ids[-1] == PH and r.num_output_placeholders == 1
    assert r.output_token_ids == [] and r.num_output_tokens == 1
    so2 = s.schedule(async_scheduling=True)
    e2 = _entry(so2, "a")
    assert e2.token_ids == (PH,) and e2.start_position == 7 and e2.sample and e2.block_ids == (0, 1)
    assert r.all_token_ids[7:] == [PH, PH]
    assert s.update(so1, {"a": [42]}) == []
    assert r.all_token_ids[7:] == [42, PH] and r.output_token_ids == [42] and r.num_output_placeholders == 1
    s.update(so2, {"a": [43]})
    assert r.output_token_ids == [42, 43] and r.num_output_placeholders == 0
    assert s.stats.async_steps == 2 and s.stats.scheduled_tokens == 8


def test_request_is_not_scheduled_past_max_tokens():
    s = _sched()
    r = _req("a", [1, 2, 3], max_tokens=2)
    s.add_request(r)
    so1 = s.schedule(async_scheduling=True)
    so2 = s.schedule(async_scheduling=True)  # computes token 1, samples token 2 (the last)
    so3 = s.schedule(async_scheduling=True)
    assert [e.request_id for e in so2.requests] == ["a"] and so3.is_empty
    s.update(so1, {"a": [7]})
    assert s.update(so2, {"a": [8]}) == [r]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 8]
    assert s.kv.num_free_blocks == 16


def test_eos_drops_the_in_flight_row_and_frees_everything():
    s = _sched()
    r = _req("a", [1, 2, 3], eos=(2,))
    s.add_request(r)
    so1 = s.schedule(async_scheduling=True)
    so2 = s.schedule(async_scheduling=True)  # already running when step 1 turns out to stop
    assert s.update(so1, {"a": [2]}) == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.all_token_ids == [1, 2, 3, 2]
    assert r.output_token_ids == [2] and r.num_output_placeholders == 0
    assert s.update(so2, {"a": [9]}) == []  # the wasted row's token goes nowhere
    assert r.output_token_ids == [2] and s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()
    s.kv.check_integrity()


def test_only_blocks_of_finished_steps_are_cached():
    """A block is indexed once the step that wrote its KV is done, not when it is scheduled: if the
    in-flight step fails, no later request may hit KV that was never written."""
    s = _sched()
    r = _req("a", [1, 2, 3, 4, 5, 6, 7])
    s.add_request(r)
    so1 = s.schedule(async_scheduling=True)  # positions 0..6
    so2 = s.schedule(async_scheduling=True)  # position 7 fills block 1
    s.update(so1, {"a": [8]})
    assert s.kv.pool.num_cached_blocks == 1  # block 0 only: block 1's last slot is still in flight
    assert s.fail_step(so2, "device error") == [r]
    probe = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s.add_request(probe)
    assert s.kv.match_prefix(probe).num_tokens == 4


def test_preempted_request_gets_its_in_flight_token_and_recomputes():
    s = _sched(num_blocks=3, block_size=4, budget=64)
    a, b = _req("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=5), _req("b", [9, 9, 9], max_tokens=5)
    b.priority = 1  # the preemption victim
    s.add_request(a)
    s.add_request(b)
    so1 = s.schedule(async_scheduling=True)  # a: 2 blocks, b: 1 block: the pool is full
    assert [e.request_id for e in so1.requests] == ["a", "b"]
    so2 = s.schedule(async_scheduling=True)  # a's placeholder needs a 3rd block: b is preempted
    assert [e.request_id for e in so2.requests] == ["a"] and so2.preempted_request_ids == ("b",)
    assert b.status == RequestStatus.PREEMPTED and b.all_token_ids == [9, 9, 9, PH]
    s.update(so1, {"a": [11], "b": [12]})
    assert b.all_token_ids == [9, 9, 9, 12] and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    s.update(so2, {"a": [13]})
    assert a.output_token_ids == [11, 13]
    s.kv.check_integrity()


def test_request_waits_a_step_for_a_prefix_block_being_computed():
    """B shares A's first two blocks. Sync: A computes them in step 1 while B waits, then B hits both.
    Async: B arrives while A's prefill is in flight, waits, and hits both once that step is done."""
    shared = list(range(20, 28))
    # sync: both arrive together
    s = _sched()
    s.add_request(_req("a", shared + [1, 2]))
    s.add_request(_req("b", shared + [3, 4, 5]))
    so1 = s.schedule()
    assert [e.request_id for e in so1.requests] == ["a"] and s.stats.deferred_admissions == 1
    s.update(so1, {"a": [9]})
    so2 = s.schedule()
    b = _entry(so2, "b")
    assert b.start_position == 8 and b.token_ids == (3, 4, 5) and b.block_ids[:2] == so1.requests[0].block_ids[:2]
    assert s.stats.prefix_hit_tokens == 8 and s.stats.scheduled_tokens == 10 + 1 + 3
    # async: b arrives after a's prefill was launched
    s = _sched()
    s.add_request(_req("a", shared + [1, 2]))
    so1 = s.schedule(async_scheduling=True)
    s.add_request(_req("b", shared + [3, 4, 5]))
    so2 = s.schedule(async_scheduling=True)
    assert [e.request_id for e in so2.requests] == ["a"] and s.stats.deferred_admissions == 1
    s.update(so1, {"a": [9]})
    so3 = s.schedule(async_scheduling=True)
    b = _entry(so3, "b")
    assert b.start_position == 8 and b.block_ids[:2] == so1.requests[0].block_ids[:2]
    assert s.stats.prefix_hit_tokens == 8


def test_a_waiting_prefix_keeps_its_place_in_line():
    """While the head of the queue waits for a prefix block, nothing behind it (here: a lower
    priority request) is admitted in its place: the seat is still there for it next step."""
    s = Scheduler(SchedulerConfig(64, 2, 128, True), CacheConfig(4, 64, True, False))
    shared = list(range(20, 36))
    r, w, low = _req("R", shared + [1], 30), _req("W", shared + [2, 3], 4), _req("LOW", [7] * 5, 40)
    low.priority = 10
    for q in (r, w, low):
        s.add_request(q)
    so1 = s.schedule()
    assert [e.request_id for e in so1.requests] == ["R"] and s.stats.deferred_admissions == 1
    s.update(so1, {"R": [5]})
    so2 = s.schedule()
    assert [e.request_id for e in so2.requests] == ["R", "W"] and _entry(so2, "W").start_position == 16


def test_results_of_an_aborted_request_never_reach_a_new_one_with_its_id():
    s = _sched()
    old = _req("a", [1, 2, 3, 4, 5])
    s.add_request(old)
    so1 = s.schedule(async_scheduling=True)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    new = _req("a", [9, 8, 7])
    s.add_request(new)
    so2 = s.schedule(async_scheduling=True)
    assert s.update(so1, {"a": [42]}) == [] and new.all_token_ids == [9, 8, 7, PH]
    s.update(so2, {"a": [43]})
    assert new.output_token_ids == [43] and old.output_token_ids == []
    s.kv.check_integrity()
