"""The scheduler's side of disaggregated serving, step by step with the in-process fake connector:
remote KV is a committed prefix hit charged nothing, the connector metadata lists exactly the loads
the step's frozen SchedulerOutput committed (the filtered batch), and holds, aborts and failures
never leak a block."""

from __future__ import annotations

from tallyserve.config import CacheConfig, SchedulerConfig
from tallyserve.core.scheduler import Scheduler
from tallyserve.distributed.kv_transfer.base import KVConnectorOutput
from tallyserve.core.remote_kv import RemoteKVScheduling
from tallyserve.request import Request, RequestStatus
from tallyserve.sampling_params import SamplingParams
from tests.kv_fake_connector import FakeConnector, remote_params
from tests.kv_oracle import OracleRunner, reference_output

BS = 4


def _setup(num_blocks=32, budget=64, policy="recompute", max_num_seqs=8, producer_timeout=None):
    conn = FakeConnector(BS, policy, finish_rate=0.0)
    if producer_timeout is not None:
        import dataclasses

        conn.config = dataclasses.replace(conn.config, hold_timeout_s=producer_timeout)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs, 128, True), CacheConfig(BS, num_blocks, True, False),
                      kv_connector=conn)
    runner = OracleRunner(num_blocks, BS)
    conn.scheduler, conn.runner = sched, runner
    return sched, conn, runner


def _remote(rid, prompt, conn, max_tokens=3):
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens=max_tokens)
    conn.prompts["p-" + rid] = prompt
    req.kv_transfer_params = remote_params("p-" + rid, len(prompt), BS)
    return req


def _step(sched, conn, runner, finish=()):
    so = sched.schedule()
    out = None
    if not so.is_empty:
        out = runner.execute(so, {r: q.all_token_ids for r, q in sched.requests.items()})
    conn.start_load_kv(so.kv_connector_metadata)
    report = KVConnectorOutput()
    for rid in finish:
        conn.finish_rate = 1.0
    if finish:
        report = conn.get_finished()
        conn.finish_rate = 0.0
    failed = sched.kv_xfer.process(report)
    if out is not None:
        sched.update(so, out[1])
    return so, failed


def test_remote_load_is_a_committed_hit_charged_nothing():
    sched, conn, runner = _setup()
    prompt = list(range(10, 23))  # 13 tokens: 12 loaded (3 blocks), the last one computed here
    req = _remote("a", prompt, conn)
    sched.add_request(req)
    so, _ = _step(sched, conn, runner)
    assert so.total_tokens == 0 and so.is_empty
    assert [ld.request_id for ld in so.kv_loads] == ["a"] and so.kv_connector_metadata.loads == so.kv_loads
    load = so.kv_loads[0]
    assert (load.start_position, load.num_tokens, len(load.block_ids)) == (0, 12, 3)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 0
    assert sched.kv.block_ids("a")[:3] == load.block_ids  # committed before anything was charged
    so, _ = _step(sched, conn, runner, finish=["a"])  # nothing scheduled while loading; the load lands
    assert so.is_empty and req.status == RequestStatus.WAITING and req.num_computed_tokens == 12
    so, _ = _step(sched, conn, runner)  # scheduled like a whole-prompt prefix hit: one token
    assert [(e.request_id, e.start_position, e.num_tokens) for e in so.requests] == [("a", 12, 1)]
    assert so.total_tokens == 1 and not so.kv_loads
    while sched.has_unfinished_requests():
        _step(sched, conn, runner)
    assert req.output_token_ids == reference_output(prompt, 3)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_local_prefix_hit_first_then_only_the_missing_blocks():
    sched, conn, runner = _setup()
    shared = list(range(40, 48))  # two full blocks computed locally first
    local = Request("l", shared + [1, 2], SamplingParams(max_tokens=1, temperature=0.0), max_tokens=1)
    sched.add_request(local)
    while sched.has_unfinished_requests():
        _step(sched, conn, runner)
    req = _remote("b", shared + list(range(60, 67)), conn)  # 15 tokens: 8 local, 6 remote, 1 computed
    sched.add_request(req)
    so, _ = _step(sched, conn, runner)
    (load,) = so.kv_loads
    assert (load.start_position, load.num_tokens, len(load.block_ids)) == (8, 6, 2)
    assert load.remote_block_ids == tuple(req.kv_transfer_params["remote_block_ids"][2:4])


def test_filtered_batch_candidate_that_does_not_fit_is_not_in_the_metadata():
    """A remote candidate the pool cannot hold is asked about (get_num_new_matched_tokens) but not
    committed: no load for it in the step's metadata, and the receiver is never told to wait."""
    sched, conn, runner = _setup(num_blocks=4)
    hog = Request("hog", list(range(1, 14)), SamplingParams(max_tokens=1, temperature=0.0), max_tokens=1)
    sched.add_request(hog)
    sched.add_request(_remote("c", list(range(50, 63)), conn))
    so = sched.schedule()
    assert [e.request_id for e in so.requests] == ["hog"]
    assert so.kv_loads == () and not so.kv_connector_metadata
    conn.start_load_kv(so.kv_connector_metadata)
    assert conn.asked == []


def test_filtered_batch_admitted_then_dropped_in_the_same_step():
    """A request committed for a remote load and ended before the step's output is built (here: a
    policy hook that ends it right after admission) is not in that step's connector metadata; its
    blocks are back at once, since no worker was ever asked to write into them."""
    sched, conn, runner = _setup()
    req = _remote("d", list(range(70, 83)), conn)
    sched.add_request(req)
    keep = sched.kv_xfer.admit_waiting

    def admit_then_drop(idx, budget, scheduled):
        r = sched.waiting[idx]
        n = keep(idx, budget, scheduled)
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and sched.kv.block_ids(r.request_id)
        sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)  # trimmed in the same step
        return n

    sched.kv_xfer.admit_waiting = admit_then_drop
    so = sched.schedule()
    assert so.kv_loads == () and not so.kv_connector_metadata
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks and not sched.has_unfinished_requests()


def test_abort_while_loading_keeps_blocks_until_the_worker_reports():
    sched, conn, runner = _setup()
    req = _remote("e", list(range(5, 20)), conn)
    sched.add_request(req)
    _step(sched, conn, runner)
    sched.finish_requests(["e"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.block_ids("e") and sched.has_unfinished_requests()  # the load still writes there
    _step(sched, conn, runner, finish=["e"])
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_failed_load_recomputes_or_fails():
    for policy in ("recompute", "fail"):
        sched, conn, runner = _setup(policy=policy)
        prompt = list(range(30, 41))
        req = _remote("f", prompt, conn)
        sched.add_request(req)
        _step(sched, conn, runner)
        conn.pending.clear()
        failed = sched.kv_xfer.process(KVConnectorOutput(failed_recving={"f": "dropped"}))
        assert sched.kv_xfer.stats.load_failures == 1
        if policy == "fail":
            assert failed == [req] and req.status == RequestStatus.FINISHED_ERROR and "dropped" in req.error
        else:
            assert failed == [] and req.status == RequestStatus.WAITING
            while sched.has_unfinished_requests():
                _step(sched, conn, runner)
            assert req.output_token_ids == reference_output(prompt, 3)
        assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_producer_holds_blocks_until_pulled_or_timeout():
    for pulled in (True, False):
        sched, conn, runner = _setup(producer_timeout=30.0)
        req = Request("g", list(range(3, 15)), SamplingParams(max_tokens=1, temperature=0.0), max_tokens=1)
        req.kv_transfer_params = {"do_remote_decode": True}
        sched.add_request(req)
        while sched.requests:
            _step(sched, conn, runner)
        params = req.kv_transfer_output
        assert params["do_remote_prefill"] and params["remote_block_ids"] == list(sched.kv.block_ids("g"))
        assert sched.kv_xfer.num_held == 1 and sched.has_unfinished_requests()
        if pulled:
            sched.kv_xfer.process(KVConnectorOutput(finished_sending={"g"}))
        else:
            sched.kv_xfer.expire_holds(now=1e12)
            assert sched.kv_xfer.stats.holds_expired == 1
        assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_sibling_waits_for_the_shared_load_then_hits_its_blocks():
    sched, conn, runner = _setup()
    prompt = list(range(90, 107))
    a, b = _remote("s0", prompt, conn), _remote("s1", prompt, conn)
    b.kv_transfer_params = a.kv_transfer_params  # n = 2: one remote prefill for both
    sched.add_request(a)
    sched.add_request(b)
    so, _ = _step(sched, conn, runner)
    assert [ld.request_id for ld in so.kv_loads] == ["s0"]  # s1 waits: the same KV is on its way
    _step(sched, conn, runner, finish=["s0"])
    while sched.has_unfinished_requests():
        _step(sched, conn, runner)
    assert conn.asked == ["s0"]
    assert a.output_token_ids == b.output_token_ids == reference_output(prompt, 3)
    assert isinstance(sched.kv_xfer, RemoteKVScheduling)


def test_kv_transfer_config_names_the_bad_key():
    import pytest

    from tallyserve.config.kv_transfer import KVTransferConfig

    cfg = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
    assert cfg.is_consumer and not cfg.is_producer and cfg.kv_load_failure_policy == "recompute"
    for bad, message in (('{"kv_role": "kv_sideways"}', r"^kv_transfer_config: kv_role must be one of "),
                         ('{"kv_connector": "Lmcache"}', r"^kv_transfer_config: kv_connector must be one of "),
                         ('{"kv_load_failure_policy": "retry"}',
                          r"^kv_transfer_config: kv_load_failure_policy must be one of "),
                         ("[1]", r"^kv_transfer_config must be a JSON object, got list"),
                         ('{"load_timeout_s": -1}', r"^kv_transfer_config: load_timeout_s must be a positive number"),
                         ('{"colour": 1}', r"^kv_transfer_config: unknown key\(s\) \['colour'\]"),
                         ("{", r"^kv_transfer_config is not valid JSON: ")):
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.parse(bad)


def test_rank_reports_wait_for_every_rank():
    """With tensor parallelism a load is done only when every rank's share is; a rank's failure is
    reported only once the other rank stopped writing too (no block freed under a running READ)."""
    from tallyserve.distributed.kv_transfer.base import RankReports

    rr = RankReports(2)
    out = rr.merge([KVConnectorOutput(finished_recving={"a"}, failed_recving={"b": "rank 0 lost it"}),
                    KVConnectorOutput(finished_sending={"s"})])
    assert not out.finished_recving and not out.failed_recving and not out.finished_sending
    out = rr.merge([KVConnectorOutput(finished_sending={"s"}), KVConnectorOutput(finished_recving={"a", "b"})])
    assert out.finished_recving == {"a"} and out.failed_recving == {"b": "rank 0 lost it"}
    assert out.finished_sending == {"s"}
    assert rr.merge([KVConnectorOutput(), KVConnectorOutput()]).finished_recving == set()


def test_params_too_close_to_the_producers_deadline_are_computed_here():
    """A request that waited in the queue until its producer may free the blocks before a load could
    end is computed locally: a late READ must never cache another prompt's KV under its hashes."""
    import time as _time

    sched, conn, runner = _setup()
    prompt = list(range(11, 30))
    req = _remote("x", prompt, conn)
    req.kv_transfer_params["expires_at"] = _time.time() + 1.0  # < load_timeout_s (30 s) from now
    sched.add_request(req)
    so, _ = _step(sched, conn, runner)
    assert not so.kv_loads and [e.request_id for e in so.requests] == ["x"] and conn.asked == []
    assert sched.kv_xfer.stats.loads_expired == 1
    while sched.has_unfinished_requests():
        _step(sched, conn, runner)
    assert req.output_token_ids == reference_output(prompt, 3)
