"""Stateful fuzzing (hypothesis RuleBasedStateMachine) of the real Scheduler + KV cache manager.

Rules add requests (n > 1: several requests sharing one prompt, prompts sharing prefixes), run
steps through the model-free oracle runner, propose speculative drafts (some right, some wrong),
and abort requests between steps or while a step "runs" (after schedule, before update).
Configurations cover chunking on/off, prefix caching, partial reuse, a host KV tier, tiny
budgets and tiny pools. After every step: the ledger is exact, the KV of
every computed row is right, the pool is intact, and an idle scheduler holds no block. At the
end every request finishes, with the reference output unless aborted.

Examples: env TALLYSERVE_FUZZ_EXAMPLES (default 25; `make fuzz`-style runs use thousands).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_oracle import VOCAB, OracleRunner, next_token, reference_output

EXAMPLES = int(os.environ.get("TALLYSERVE_FUZZ_EXAMPLES", "100"))
MAX_DRAIN_STEPS = 4000
_TOTALS: dict[str, int] = {}


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_len = draw(st.integers(6, 64))
    min_blocks = -(-max_len // block_size)  # one longest request always fits: progress is possible
    chunked = draw(st.booleans())
    return dict(
        block_size=block_size,
        max_len=max_len,
        num_blocks=min_blocks + draw(st.sampled_from([0, 0, 1, 2, 5, 40])),
        chunked=chunked,
        budget=draw(st.integers(1 if chunked else max_len, max_len + 8)),
        max_num_seqs=draw(st.integers(1, 6)),
        prefix=draw(st.booleans()),
        partial=draw(st.booleans()),
        host_blocks=draw(st.sampled_from([0, 0, 1, 3, 24])),  # host KV tier for evicted prefix blocks
    )


class SchedulerHypothesisMachine(RuleBasedStateMachine):
    @initialize(cfg=configs(), shared=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40))
    def setup(self, cfg, shared):
        self.cfg = cfg
        self.shared = shared
        self.sched = Scheduler(
            SchedulerConfig(cfg["budget"], cfg["max_num_seqs"], cfg["max_len"], cfg["chunked"]),
            CacheConfig(cfg["block_size"], cfg["num_blocks"], cfg["prefix"], cfg["partial"], cfg["host_blocks"]),
        )
        self.runner = OracleRunner(cfg["num_blocks"], cfg["block_size"], cfg["host_blocks"])
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.next_id = 0

    # ----------------------------------------------------------------- rules
    @rule(share=st.integers(0, 40), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
          n=st.integers(1, 3), max_tokens=st.integers(1, 16), priority=st.integers(0, 2))
    def add_request(self, share, tail, n, max_tokens, priority):
        max_len = self.cfg["max_len"]
        prompt = (self.shared[:share] + tail)[: max_len - 1]
        max_tokens = max(1, min(max_tokens, max_len - len(prompt)))
        for _ in range(n):  # n > 1: sibling requests with one prompt, as the engine adds them
            rid = f"r{self.next_id}"
            self.next_id += 1
            req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                          max_tokens=max_tokens, priority=priority)
            self.requests[rid] = req
            self.sched.add_request(req)

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data(), num_right=st.integers(0, 4), num_wrong=st.integers(0, 2))
    def propose_drafts(self, data, num_right, num_wrong):
        """Speculative drafts for a running request: some right (greedy), then some wrong."""
        req = data.draw(st.sampled_from(sorted(self.sched.running, key=lambda r: r.request_id)))
        ctx, drafts = list(req.all_token_ids), []
        for _ in range(num_right):
            drafts.append(next_token(ctx))
            ctx.append(drafts[-1])
        drafts += [(next_token(ctx) + 1 + i) % VOCAB for i in range(num_wrong)]
        self.sched.set_draft_tokens(req.request_id, drafts)
        _count("drafts_proposed", len(drafts))

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data(), during_step=st.booleans())
    def abort(self, data, during_step):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        if during_step:
            self._step(abort=rid)
        else:
            self._finish(self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED))

    # ----------------------------------------------------------------- helpers
    def _finish(self, reqs):
        for r in reqs:
            assert r.request_id not in self.finished
            self.finished[r.request_id] = r

    def _step(self, abort=None):
        so = self.sched.schedule()
        assert so.total_tokens == sum(e.num_tokens for e in so.requests) <= self.cfg["budget"]
        if abort is not None:  # the client goes away while the step runs
            self._finish(self.sched.finish_requests([abort], RequestStatus.FINISHED_ABORTED))
            _count("aborts_during_step", int(any(e.request_id == abort for e in so.requests)))
        if so.is_empty:
            return
        contexts = {rid: r.all_token_ids for rid, r in self.requests.items()}
        batch, sampled = self.runner.execute(so, contexts)
        ledger.check_step(so.total_tokens, batch.num_tokens, so.max_num_batched_tokens)
        self._finish(self.sched.update(so, sampled))

    # ----------------------------------------------------------------- invariants
    @invariant()
    def pool_is_intact(self):
        kv = self.sched.kv
        kv.check_integrity()
        if not self.sched.has_unfinished_requests():
            assert kv.num_free_blocks == kv.num_total_blocks, "blocks leaked while idle"
        assert self.sched.stats.ledger_violations == 0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished_requests():
                break
            self._step()
            self.sched.kv.check_integrity()
        assert not self.sched.has_unfinished_requests(), f"stuck: {self.sched.requests}"
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_total_blocks
        assert set(self.finished) == set(self.requests)
        for key, value in self.sched.stats.as_dict().items():
            _count(key, value)
        _count("evictions", self.sched.kv.pool.num_evictions)
        for rid, r in self.requests.items():
            want = reference_output(r.prompt_token_ids, r.max_tokens)
            if r.status == RequestStatus.FINISHED_ABORTED:
                assert r.output_token_ids == want[: len(r.output_token_ids)]
            else:
                assert r.status == RequestStatus.FINISHED_LENGTH, r
                assert r.output_token_ids == want


def _count(key: str, value: int) -> None:
    _TOTALS[key] = _TOTALS.get(key, 0) + value


SchedulerHypothesisMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck),
    derandomize=EXAMPLES <= 100,  # CI replays a fixed set; `make fuzz` explores fresh cases
)
TestHypothesisScheduler = SchedulerHypothesisMachine.TestCase


def test_hypothesis_machine_covered_the_hard_cases():
    """The runs above did preempt, hit full and partial blocks, evict, and abort mid-step."""
    if not _TOTALS.get("steps"):
        run_state_machine_as_test(SchedulerHypothesisMachine, settings=SchedulerHypothesisMachine.TestCase.settings)
    for key in ("preemptions", "prefix_hit_tokens", "partial_hit_tokens", "host_hit_tokens", "evictions",
                "aborts_during_step", "spec_accepted"):
        assert _TOTALS.get(key, 0) > 0, (key, _TOTALS)
