"""`simulate` on every workload kind: the real scheduler on a virtual clock, with the ledger exact
and KV integrity checked after every step, under chunking, prefix reuse, eviction and preemption."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tallyserve.bench.workloads import WorkloadOptions, build_workload
from tallyserve.cli import main
from tallyserve.config import EngineArgs
from tallyserve.sim.cli import engine_config_for, load_model_config
from tallyserve.sim.cost_model import load_cost_model
from tallyserve.sim.simulator import SimOptions, Simulator

SMALL = dict(random_input_len=60, random_output_len=12, random_range_ratio=0.5, shared_prefix_groups=3,
             shared_prefix_len=70, shared_prefix_suffix_len=9, multi_turn_turns=4, multi_turn_user_len=20,
             multi_turn_system_len=30, think_time=0.2, request_rate=40.0)


def _simulate(workload, num_blocks=96, budget=64, max_model_len=600, **sim_kw):
    mc = load_model_config("llama-3-8b")
    args = EngineArgs(num_gpu_blocks_override=num_blocks, block_size=8, max_num_batched_tokens=budget,
                      max_num_seqs=8, max_model_len=max_model_len)
    config = engine_config_for(args, mc, 141e9)
    opts = SimOptions(**{"integrity_every": 1, "build_batches": True, **sim_kw})
    sim = Simulator(config, load_cost_model("h200", mc), opts)
    return sim, sim.run(workload)


def _assert_clean(workload, res):
    stats = res.stats
    assert all(r.ok for r in res.records), [r.error for r in res.records if not r.ok][:3]
    assert stats["ledger"]["violations"] == 0
    assert stats["ledger"]["scheduled_tokens"] == stats["ledger"]["forward_tokens"]
    assert stats["kv"]["integrity_checks"] >= stats["steps"]
    for spec, rec in zip(workload.requests, res.records):
        assert rec.request_id == spec.request_id
        assert rec.completion_tokens == spec.max_tokens  # EOS ignored: every request runs to max_tokens
        assert len(rec.chunk_times_s) == spec.max_tokens
        assert 0 < rec.ttft_s <= rec.latency_s
        assert rec.start_s >= (spec.arrival_s or 0.0)


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_synthetic_workloads(kind):
    w = build_workload(WorkloadOptions(workload=kind, num_requests=40, seed=1, **SMALL))
    sim, res = _simulate(w)
    _assert_clean(w, res)
    if kind == "random":
        assert [r.prompt_tokens for r in res.records] == [len(s.prompt.split()) for s in w.requests]
    else:
        assert res.stats["prefix_hit_rate"] > 0.2
    assert res.stats["kv"]["evictions"] > 0 and res.stats["kv"]["peak_blocks_used"] <= 96


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "multi-turn"])
def test_tight_pool_preempts_and_recovers(kind):
    """Everything arrives at once into a pool that holds a few requests: preemption by recompute."""
    w = build_workload(WorkloadOptions(workload=kind, num_requests=30, seed=5, **dict(SMALL, request_rate=1e9)))
    _, res = _simulate(w, num_blocks=40, budget=48, max_model_len=320)
    _assert_clean(w, res)
    assert res.stats["preemptions"] > 0 and res.stats["kv"]["peak_blocks_used"] == 40


def test_multi_turn_history_carries_replies_and_think_time():
    w = build_workload(WorkloadOptions(workload="multi-turn", num_requests=12, seed=2, **SMALL))
    _, res = _simulate(w, num_blocks=400)
    _assert_clean(w, res)
    by_id = {r.request_id: r for r in res.records}
    for conv in w.conversations():
        for prev, spec in zip(conv, conv[1:]):
            a, b = by_id[prev.request_id], by_id[spec.request_id]
            user = len(spec.messages[0]["content"].split()) + 3  # <start> <user> words <end>
            # previous prompt + reply + <end>, then the new user message, then <start> <assistant>
            assert b.prompt_tokens == a.prompt_tokens + a.completion_tokens + 1 + user + 2
            assert b.start_s >= a.start_s + a.latency_s + spec.think_time_s - 1e-9
    assert res.stats["prefix_hit_rate"] > 0.5


def test_file_traces(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    rows = [{"arrival_s": 0.01 * i, "prompt": " ".join(["tok"] * (5 + i)), "max_tokens": 4} for i in range(6)]
    rows += [{"prompt_token_ids": list(range(20, 60)), "max_tokens": 3},
             {"conversation_id": "c", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 5},
             {"conversation_id": "c", "messages": [{"role": "user", "content": "d e"}], "max_tokens": 5}]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(json.dumps([{"id": f"s{i}", "conversations": [
        {"from": "human", "value": "hello " * (3 + i)}, {"from": "gpt", "value": "x " * (2 + i)},
        {"from": "human", "value": "again"}, {"from": "gpt", "value": "y y"}]} for i in range(5)]))
    for path in (jsonl, sharegpt):
        w = build_workload(WorkloadOptions(workload=f"file:{path}", num_requests=1000, request_rate=20.0))
        _, res = _simulate(w)
        _assert_clean(w, res)
    assert res.records[0].prompt_tokens == 3 + 2 + 3  # <start> <user> 3 words <end> <start> <assistant>


def test_max_concurrency_is_respected():
    w = build_workload(WorkloadOptions(workload="random", num_requests=20, **dict(SMALL, request_rate=1e6)))
    _, res = _simulate(w, num_blocks=400, max_concurrency=3)
    _assert_clean(w, res)
    events = sorted([(r.start_s, 1) for r in res.records] + [(r.start_s + r.latency_s, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 3


def test_ledger_violation_fails_only_its_step():
    w = build_workload(WorkloadOptions(workload="random", num_requests=10, **SMALL))

    def corrupt_once(original):
        def schedule(**kw):
            so = original(**kw)
            if so.step_id == 3:
                return dataclasses.replace(so, total_tokens=so.total_tokens + 1)
            return so
        return schedule

    mc = load_model_config("llama-3-8b")
    config = engine_config_for(EngineArgs(num_gpu_blocks_override=200, block_size=8, max_num_batched_tokens=64,
                                          max_model_len=600), mc, 141e9)
    sim = Simulator(config, load_cost_model("h200", mc), SimOptions(integrity_every=1))
    sim.scheduler.schedule = corrupt_once(sim.scheduler.schedule)
    res = sim.run(w)
    assert res.stats["ledger"]["violations"] == 1
    bad = [r for r in res.records if not r.ok]
    assert bad and all(r.error_kind == "ledger_violation" for r in bad)
    assert sum(r.ok for r in res.records) == 10 - len(bad) > 0


def test_cli_overload_replay_small(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["simulate", "--scenario", "overload-replay", "--num-requests", "150", "--num-gpu-blocks-override",
               "600", "--request-rate", "14", "--disable-tqdm", "--output", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    sim = result["simulator"]
    assert result["completed"] == result["num_requests"] == 150 and result["errors"] == 0
    assert sim["ledger"]["violations"] == 0 and sim["ledger"]["exact"] is True
    assert sim["kv"]["evictions"] > 0 and sim["prefix_hit_rate"] > 0
    assert sim["kv"]["host_blocks_offloaded"] > 0 and sim["host_hit_tokens"] > 0
    assert result["config"]["scheduler"]["max_num_batched_tokens"] == 4096
    assert result["config"]["cache"]["enable_partial_reuse"] is True
    assert result["total_output_tokens"] == sum(r["completion_tokens"] for r in result["requests"])
    for key in ("mean_ttft_ms", "p50_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "request_throughput", "timeline"):
        assert result[key] is not None, key
    assert png.stat().st_size > 10_000


def test_kv_pool_from_hardware_memory():
    mc = load_model_config("mistral-nemo-12b")
    config = engine_config_for(EngineArgs(), mc, 141e9)
    per_block = 2 * 40 * 8 * 128 * 2 * 16
    weights = 2 * (40 * (5120 * 4096 * 2 + 2 * 5120 * 1024 + 3 * 5120 * 14336) + 2 * 131072 * 5120)
    assert config.cache_config.num_blocks == (int(141e9 * 0.9) - weights) // per_block
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        load_model_config("no-such-model")


def test_cascade_attention_shortens_shared_prefix_decode_only():
    """The same shared-prefix workload with cascade attention and with ``disable_cascade_attn``: the
    same schedule and tokens, a shorter makespan when the decode rows share a prefix of >= 256 tokens."""
    w = build_workload(WorkloadOptions(workload="shared-prefix", num_requests=12, seed=3, shared_prefix_groups=1,
                                       shared_prefix_len=400, shared_prefix_suffix_len=6, random_output_len=16,
                                       request_rate=float("inf")))
    runs = {}
    for disable in (False, True):
        mc = load_model_config("llama-3-8b")
        args = EngineArgs(num_gpu_blocks_override=2000, block_size=16, max_num_batched_tokens=2048, max_num_seqs=16,
                          max_model_len=1024, disable_cascade_attn=disable)
        res = Simulator(engine_config_for(args, mc, 141e9), load_cost_model("h200", mc),
                        SimOptions(integrity_every=1)).run(w)
        _assert_clean(w, res)
        runs[disable] = res
    on, off = runs[False], runs[True]
    assert on.stats["ledger"] == off.stats["ledger"] and on.stats["steps"] == off.stats["steps"]
    assert on.duration_s < off.duration_s and on.stats["busy_s"] < off.stats["busy_s"]
