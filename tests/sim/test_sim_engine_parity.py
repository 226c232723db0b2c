"""The simulator and the real engine (tiny model on CPU) admit identical batches step by step:
same request ids, token counts, start positions and KV moves (offloads, restores, partial copies),
for the same trace and engine arguments, under chunked prefill, full and partial prefix reuse,
a host tier, preemption and eviction, with and without async scheduling."""

from __future__ import annotations

import random

import pytest

from tallyserve import LLM, SamplingParams
from tallyserve.bench.workloads import RequestSpec, Workload
from tallyserve.sim.cost_model import HARDWARE, RooflineCostModel
from tallyserve.sim.simulator import SimOptions, Simulator

MAX_TOKENS = 10

CONFIGS = {
    # chunked prefill, prefix caching with partial reuse, a pool that forces preemption
    "chunked-tight": dict(num_gpu_blocks_override=20, block_size=4, max_num_batched_tokens=24, max_num_seqs=5,
                          max_model_len=80),
    # a tight pool with a host tier: evicted prefix blocks are offloaded, later hits restore them
    "host-tier": dict(num_gpu_blocks_override=16, block_size=4, max_num_batched_tokens=20, max_num_seqs=3,
                      max_model_len=60, kv_offload_bytes=64 * 1024),
    # no chunking, no prefix caching, roomy pool
    "plain": dict(num_gpu_blocks_override=200, block_size=8, max_num_batched_tokens=128, max_num_seqs=4,
                  max_model_len=128, enable_chunked_prefill=False, enable_prefix_caching=False),
    # prefix caching without partial reuse, budget of one decode row per request
    "full-blocks-only": dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=9, max_num_seqs=8,
                             max_model_len=80, enable_partial_reuse=False),
}


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(30)]
    out = []
    for share, tail in [(0, 5), (30, 3), (13, 9), (30, 7), (6, 2), (0, 25), (22, 4), (30, 1), (9, 14), (0, 3)]:
        out.append(shared[:share] + [rng.randrange(3, 250) for _ in range(tail)])
    return out


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulator_matches_engine_batches(tiny_dir, name, async_sched):
    prompts = _prompts()
    llm = LLM(model=tiny_dir, async_scheduling=async_sched, **CONFIGS[name])
    engine_steps = []
    engine = llm.engine
    engine.fault_injector = lambda so: engine_steps.append(
        (tuple((e.request_id, e.num_tokens, e.start_position) for e in so.requests), so.kv_transfers))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert all(len(t) == MAX_TOKENS for t in tokens.values())

    specs = [RequestSpec(o.request_id, MAX_TOKENS, prompt_token_ids=p, arrival_s=0.0) for o, p in zip(outs, prompts)]
    config = engine.config
    cost = RooflineCostModel(config.model_config, HARDWARE["h200"])
    # The simulator samples what the engine sampled, so later prefix matches see the same tokens.
    opts = SimOptions(integrity_every=1, build_batches=True, record_steps=True,
                      token_fn=lambda rid, i: tokens[rid][i], async_scheduling=async_sched)
    res = Simulator(config, cost, opts).run(Workload("parity", specs))
    assert all(r.ok and r.completion_tokens == MAX_TOKENS for r in res.records)
    assert len(res.steps) == len(engine_steps)
    for i, (sim_step, eng_step) in enumerate(zip(res.steps, engine_steps)):
        assert sim_step == eng_step, f"step {i}: simulator {sim_step} != engine {eng_step}"
    eng_stats, sim_stats = engine.scheduler.stats.as_dict(), res.stats
    assert sim_stats["preemptions"] == eng_stats["preemptions"]
    assert sim_stats["prefix_hit_tokens"] == eng_stats["prefix_hit_tokens"]
    assert sim_stats["partial_hit_tokens"] == eng_stats["partial_hit_tokens"]
    assert sim_stats["host_hit_tokens"] == eng_stats["host_hit_tokens"]
    assert sim_stats["ledger"]["scheduled_tokens"] == eng_stats["scheduled_tokens"] == eng_stats["forward_tokens"]
    assert eng_stats["async_steps"] == (eng_stats["steps"] if async_sched else 0)
    if name == "chunked-tight":
        assert eng_stats["preemptions"] > 0 and eng_stats["partial_hit_tokens"] > 0
    if name == "host-tier":
        assert eng_stats["host_hit_tokens"] > 0
    if name == "full-blocks-only":
        assert eng_stats["prefix_hit_tokens"] > 0
