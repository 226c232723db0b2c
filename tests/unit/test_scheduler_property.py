"""Property-based: random arrivals, lengths, aborts, budgets, pool sizes, EOS tokens and async
scheduling (step N+1 scheduled before step N's tokens are in) drive the real Scheduler and KV cache
manager; after every step the ledger is exact, the pool is intact, the KV of every computed row is
right, and every request finishes with the reference output."""

from __future__ import annotations

import os
import random

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_oracle import VOCAB, OracleRunner, draw_requests, reference_output

EXAMPLES = int(os.environ.get("TALLYSERVE_FUZZ_EXAMPLES", "60"))


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_len = draw(st.integers(8, 80))
    # Pool from "barely one request" to roomy, so preemption and eviction both happen.
    num_blocks = -(-max_len // block_size) + draw(st.sampled_from([0, 1, 2, 4, 32]))
    chunked = draw(st.booleans())
    budget = draw(st.integers(max_len if not chunked else 1, max_len * 2))
    async_sched = draw(st.booleans())
    cfg = dict(
        async_sched=async_sched, eos=draw(st.one_of(st.none(), st.integers(0, VOCAB - 1))),
        block_size=block_size, num_blocks=num_blocks, max_len=max_len, chunked=chunked, budget=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        prefix=draw(st.booleans()), partial=draw(st.booleans()),
        host_blocks=draw(st.sampled_from([0, 0, 2, 16])),
        spec=0 if async_sched else draw(st.sampled_from([0, 0, 1, 3])),  # the engine never mixes them
        forks=0 if async_sched else draw(st.sampled_from([0, 0, 0.2])),
        rng=draw(st.randoms(use_true_random=False)),
    )
    return cfg, draw_requests(draw, max_len, 24, st.integers(0, 6))


def propose(sched, cfg, refs):
    """Drafts from an oracle that is right most of the time and sometimes wrong (or silent)."""
    rng = cfg["rng"]
    for req in sched.running:
        if req.num_computed_tokens != req.num_tokens - 1:
            continue
        want = refs[req.request_id][req.num_output_tokens:]
        drafts = list(want[: rng.randint(0, cfg["spec"])])
        if drafts and rng.random() < 0.3:
            drafts[rng.randrange(len(drafts))] = rng.randrange(VOCAB)
        sched.set_draft_tokens(req.request_id, drafts)


def fork_some(sched, cfg, objs, reqs_by_id, refs):
    """Beam-style forks: a copy shares the parent's full blocks and copies its partial one."""
    rng = cfg["rng"]
    for req in list(sched.running):
        if rng.random() >= cfg["forks"] or req.request_id.count("+") >= 2:
            continue
        child_id = f"{req.request_id}+{len(objs)}"
        try:
            child = sched.fork_request(req.request_id, child_id)
        except ValueError:  # no free block for the copy-on-write: a beam group would wait
            continue
        objs[child_id] = child
        reqs_by_id[child_id] = reqs_by_id[req.request_id]
        refs[child_id] = refs[req.request_id]


def run_workload(cfg, reqs, max_steps=3000):
    sched = Scheduler(
        SchedulerConfig(cfg["budget"], cfg["max_num_seqs"], cfg["max_len"], cfg["chunked"]),
        CacheConfig(cfg["block_size"], cfg["num_blocks"], cfg["prefix"], cfg["partial"], cfg["host_blocks"]),
    )
    runner = OracleRunner(cfg["num_blocks"], cfg["block_size"], cfg["host_blocks"])
    objs = {}
    eos, async_sched = cfg.get("eos"), cfg.get("async_sched", False)
    refs = {rid: reference_output(prompt, 64) for rid, prompt, *_ in reqs}
    reqs_by_id = {r[0]: r for r in reqs}
    in_flight = None  # async scheduling: the launched step whose tokens are not in yet
    for step in range(max_steps):
        for rid, prompt, max_tokens, arrive, abort_at, prio in reqs:
            if arrive == step:
                r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                            max_tokens=max_tokens, priority=prio, eos_token_ids=() if eos is None else (eos,))
                objs[rid] = r
                sched.add_request(r)
            if abort_at is not None and abort_at == step and rid in sched.requests:
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        so = sched.schedule(async_scheduling=async_sched)
        assert so.total_tokens == sum(e.num_tokens for e in so.requests) <= cfg["budget"]
        for e in so.requests:  # no row past the last token that needs KV (the final one is only sampled)
            _, prompt, max_tokens, *_ = reqs_by_id[e.request_id]
            assert e.start_position + e.num_tokens <= len(prompt) + max_tokens - 1, (e, max_tokens)
        launched = None
        if so.requests:
            batch, sampled = runner.execute(so, {rid: r.all_token_ids for rid, r in objs.items()})
            ledger.check_step(so.total_tokens, batch.num_tokens, cfg["budget"])
            launched = (so, sampled)
        if async_sched:  # the previous step's results arrive after this one was scheduled
            launched, in_flight = in_flight, launched
        if launched is not None:
            sched.update(*launched)
            if cfg.get("spec"):
                propose(sched, cfg, refs)
            if cfg.get("forks"):
                fork_some(sched, cfg, objs, reqs_by_id, refs)
        sched.kv.check_integrity()
        if step > 10 and not sched.has_unfinished_requests() and in_flight is None:
            break
    assert not sched.has_unfinished_requests(), f"requests left after {max_steps} steps: {sched.requests}"
    assert sched.kv.num_free_blocks == cfg["num_blocks"]
    for rid, r in objs.items():
        _, prompt, max_tokens, _, abort_at, _ = reqs_by_id[rid]
        want = reference_output(prompt, max_tokens, eos)
        assert r.num_output_placeholders == 0 or r.status == RequestStatus.FINISHED_ABORTED
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == want[: len(r.output_token_ids)]
        else:
            stopped = eos is not None and want[-1] == eos
            assert r.status == (RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH), r
            assert r.output_token_ids == want
    return sched, objs


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 100)
@given(workloads())
def test_hypothesis_scheduler_invariants(workload):
    cfg, reqs = workload
    stats = run_workload(cfg, reqs)[0].stats
    assert stats.ledger_violations == 0
    assert stats.spec_accepted <= stats.spec_proposed
    assert (stats.async_steps == stats.steps) if cfg["async_sched"] else stats.async_steps == 0


BASE = dict(block_size=4, max_len=40, chunked=True, budget=16, max_num_seqs=4, prefix=True, partial=True,
            host_blocks=0, spec=0)
SHARED = list(range(10, 30))


@pytest.mark.parametrize(
    "overrides, reqs, stat",
    [
        # a pool of 12 blocks for three 30-token requests: someone must be preempted
        (dict(num_blocks=12), [(f"p{i}", list(range(i, i + 20)), 10, 0, None, 0) for i in range(3)], "preemptions"),
        # the second request shares 6 tokens: one full block plus 2 tokens copied from a cached block
        (dict(num_blocks=32), [("a", SHARED[:10], 2, 0, None, 0), ("b", SHARED[:6] + [1, 2, 3], 2, 4, None, 0)],
         "partial_hit_tokens"),
        # fillers evict the first request's prefix; the host tier brings it back for the last one
        (dict(num_blocks=10, host_blocks=16), [("a", SHARED[:17], 1, 0, None, 0)]
         + [(f"f{i}", list(range(40 + 20 * i, 57 + 20 * i)), 1, 1 + i, None, 0) for i in range(3)]
         + [("b", SHARED[:17] + [5], 1, 8, None, 0)], "host_hit_tokens"),
        # an oracle proposer: some drafts accepted, some rejected
        (dict(num_blocks=32, spec=3), [(f"s{i}", list(range(i, i + 5)), 20, 0, None, 0) for i in range(3)],
         "spec_accepted"),
        # beam-style forks in a tight pool: shared full blocks, copy-on-write partial blocks, preemption
        (dict(num_blocks=14, forks=0.5), [(f"b{i}", list(range(i, i + 7)), 12, 0, None, 0) for i in range(2)],
         "forks"),
        # async scheduling in a tight pool with an EOS token: placeholders, preemption, early stops
        (dict(num_blocks=12, async_sched=True, eos=3), [(f"a{i}", list(range(i, i + 20)), 10, i % 2, None, 0)
                                                         for i in range(4)], "async_steps"),
    ],
)
def test_each_mechanism_really_runs(overrides, reqs, stat):
    cfg = dict(BASE, **overrides, rng=random.Random(0))
    sched, objs = run_workload(cfg, reqs)
    stats = sched.stats
    if stat == "forks":  # every fork finished with its parent's exact output (checked in run_workload)
        assert sum("+" in rid for rid in objs) >= 3
        return
    if stat == "async_steps":
        assert stats.preemptions > 0 and any(r.status == RequestStatus.FINISHED_STOPPED for r in objs.values())
    assert getattr(stats, stat) > 0, stats
    if stat == "spec_accepted":
        assert stats.spec_accepted < stats.spec_proposed  # wrong drafts were rejected, output still exact
