"""Stateful fuzzing of the real Scheduler + KV cache manager with remote KV loads (disaggregated
serving), through the in-process fake connector and the model-free oracle runner.

Rules add local and remote requests (n > 1 siblings sharing one remote prefill, prompts sharing
prefixes), run steps (loads complete in a random order, some fail), and abort requests, also while
their load runs. After every step: the ledger is exact, every computed row's KV (loaded or
computed) is right, the pool is intact, the workers were only ever asked for loads the step's
SchedulerOutput committed, and an idle scheduler holds no block. At the end every request
finished: with the reference output, or aborted, or failed by the "fail" policy.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core import ledger
from tallyserve.core.scheduler import Scheduler
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_fake_connector import FakeConnector, remote_params
from tests.kv_oracle import VOCAB, OracleRunner, reference_output

EXAMPLES = int(os.environ.get("TALLYSERVE_FUZZ_EXAMPLES", "25"))
_TOTALS: dict[str, int] = {}


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_len = draw(st.integers(6, 48))
    chunked = draw(st.booleans())
    return dict(
        block_size=block_size, max_len=max_len,
        num_blocks=-(-max_len // block_size) + draw(st.sampled_from([0, 1, 2, 5, 30])),
        chunked=chunked, budget=draw(st.integers(1 if chunked else max_len, max_len + 8)),
        max_num_seqs=draw(st.integers(1, 5)), prefix=draw(st.booleans()), partial=draw(st.booleans()),
        host_blocks=draw(st.sampled_from([0, 0, 3, 16])),
        policy=draw(st.sampled_from(["recompute", "fail"])), fail_rate=draw(st.sampled_from([0.0, 0.2, 0.5])),
        finish_rate=draw(st.sampled_from([0.3, 0.7, 1.0])), seed=draw(st.integers(0, 1000)),
    )


class RemoteKVMachine(RuleBasedStateMachine):
    @initialize(cfg=configs(), shared=st.lists(st.integers(0, VOCAB - 1), max_size=30))
    def setup(self, cfg, shared):
        self.cfg, self.shared = cfg, shared
        self.conn = FakeConnector(cfg["block_size"], cfg["policy"], cfg["seed"], cfg["fail_rate"], cfg["finish_rate"])
        self.sched = Scheduler(
            SchedulerConfig(cfg["budget"], cfg["max_num_seqs"], cfg["max_len"], cfg["chunked"]),
            CacheConfig(cfg["block_size"], cfg["num_blocks"], cfg["prefix"], cfg["partial"], cfg["host_blocks"]),
            kv_connector=self.conn,
        )
        self.runner = OracleRunner(cfg["num_blocks"], cfg["block_size"], cfg["host_blocks"])
        self.conn.scheduler, self.conn.runner = self.sched, self.runner
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}
        self.next_id = 0

    @rule(share=st.integers(0, 30), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
          n=st.integers(1, 3), max_tokens=st.integers(1, 8), remote=st.booleans())
    def add_request(self, share, tail, n, max_tokens, remote):
        max_len = self.cfg["max_len"]
        prompt = (self.shared[:share] + tail)[: max_len - 1]
        max_tokens = max(1, min(max_tokens, max_len - len(prompt)))
        remote_id = f"p{self.next_id}"
        self.conn.prompts[remote_id] = prompt
        for _ in range(n):  # n > 1: siblings sharing one remote prefill, as the engine adds them
            rid = f"r{self.next_id}"
            self.next_id += 1
            req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens=max_tokens)
            if remote:
                req.kv_transfer_params = remote_params(remote_id, len(prompt), self.cfg["block_size"])
            self.requests[rid] = req
            self.sched.add_request(req)

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        loading = self.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        _count("aborts_while_loading", int(loading))
        self._finish(self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED))

    @precondition(lambda self: any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.sched.requests.values()))
    @rule(data=st.data())
    def abort_while_loading(self, data):
        """The client goes away while its KV is arriving: the blocks stay until the load reports."""
        loading = sorted(rid for rid, r in self.sched.requests.items() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        rid = data.draw(st.sampled_from(loading))
        _count("aborts_while_loading", 1)
        self._finish(self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED))
        assert self.sched.kv.block_ids(rid), "blocks freed while a load writes into them"

    def _finish(self, reqs):
        for r in reqs:
            assert r.request_id not in self.finished
            self.finished[r.request_id] = r

    def _step(self, drain=False):
        so = self.sched.schedule()
        assert so.total_tokens == sum(e.num_tokens for e in so.requests) <= self.cfg["budget"]
        assert so.kv_connector_metadata.loads == so.kv_loads  # built from this output, nothing else
        assert not {ld.request_id for ld in so.kv_loads} & {e.request_id for e in so.requests}
        contexts = {rid: r.all_token_ids for rid, r in self.requests.items()}
        if not so.is_empty or so.kv_transfers:  # the step's block moves (offloads first), then its rows
            batch, sampled = self.runner.execute(so, contexts)
        # Loads start after the step's moves: a block just evicted is offloaded before a load refills it.
        self.conn.start_load_kv(so.kv_connector_metadata)
        out = self.conn.finish_all() if drain else self.conn.get_finished()
        self._finish(self.sched.kv_xfer.process(out))
        if so.is_empty:
            if so.kv_transfers:
                self.sched.update(so, {})
            return
        ledger.check_step(so.total_tokens, batch.num_tokens, so.max_num_batched_tokens)
        self._finish(self.sched.update(so, sampled))

    @invariant()
    def pool_is_intact(self):
        if not hasattr(self, "sched"):
            return
        self.sched.kv.check_integrity()
        if not self.sched.has_unfinished_requests():
            assert self.sched.kv.num_free_blocks == self.sched.kv.num_total_blocks, "blocks leaked while idle"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_unfinished_requests():
                break
            self._step(drain=True)
            self.sched.kv.check_integrity()
        assert not self.sched.has_unfinished_requests(), f"stuck: {self.sched.requests}"
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_total_blocks
        assert set(self.finished) == set(self.requests)
        for key, value in self.sched.kv_xfer.stats.as_dict().items():
            _count(key, int(value))
        for rid, r in self.requests.items():
            want = reference_output(r.prompt_token_ids, r.max_tokens)
            if r.status == RequestStatus.FINISHED_ABORTED:
                assert r.output_token_ids == want[: len(r.output_token_ids)]
            elif r.status == RequestStatus.FINISHED_ERROR:
                assert self.cfg["policy"] == "fail" and "KVTransferError" in r.error, r
            else:
                assert r.status == RequestStatus.FINISHED_LENGTH, r
                assert r.output_token_ids == want


def _count(key: str, value: int) -> None:
    _TOTALS[key] = _TOTALS.get(key, 0) + value


RemoteKVMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck),
    derandomize=EXAMPLES <= 100,
)
TestRemoteKVHypothesis = RemoteKVMachine.TestCase


def test_remote_kv_machine_covered_the_hard_cases():
    """The runs above loaded, failed loads, and aborted requests while their load ran."""
    if not _TOTALS.get("kv_loads_started"):
        from hypothesis.stateful import run_state_machine_as_test

        run_state_machine_as_test(RemoteKVMachine, settings=RemoteKVMachine.TestCase.settings)
    for key in ("kv_loads_started", "kv_loads_finished", "kv_load_failures", "aborts_while_loading"):
        assert _TOTALS.get(key, 0) > 0, (key, _TOTALS)
