"""The host KV tier on the CPU: evicted prefix blocks come back from host memory instead of being
recomputed, the tokens equal a run without the tier, and nothing leaks after aborts."""

from __future__ import annotations

import random

import pytest

from tallyserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("host_tier"), "llama")


def _prompts():
    rng = random.Random(1)
    prefix = [rng.randrange(3, 250) for _ in range(24)]
    first = [prefix + [rng.randrange(3, 250) for _ in range(3)] for _ in range(2)]
    fillers = [[rng.randrange(3, 250) for _ in range(26)] for _ in range(4)]
    return first, fillers


def _run(llm, prompts):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_evicted_prefix_is_restored_from_host(model_dir):
    first, fillers = _prompts()
    common = dict(model=model_dir, block_size=4, num_gpu_blocks_override=16, max_model_len=64)
    plain = LLM(**common)
    tiered = LLM(**common, kv_offload_bytes=1 << 20)
    for llm in (plain, tiered):
        llm.results = [_run(llm, first[:1]), _run(llm, fillers[:2]), _run(llm, fillers[2:]), _run(llm, first[1:])]
    assert tiered.results == plain.results
    s, p = tiered.stats(), plain.stats()
    assert s["block_evictions"] > 0 and s["host_blocks_offloaded"] > 0
    assert s["host_hit_tokens"] >= 16 and s["host_blocks_restored"] > 0 and s["kv_bytes_moved"] > 0
    assert p["host_hit_tokens"] == 0
    assert s["scheduled_tokens"] == s["forward_tokens"] < p["forward_tokens"]  # restored, not recomputed
    assert s["ledger_violations"] == 0
    kv = tiered.engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_total_blocks and kv.host.num_pinned == 0


def test_aborts_leak_no_host_blocks(model_dir):
    first, fillers = _prompts()
    llm = LLM(model=model_dir, block_size=4, num_gpu_blocks_override=16, max_model_len=64, kv_offload_bytes=1 << 20)
    _run(llm, first[:1] + fillers)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(first + fillers):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()
    engine.abort_request([f"a{i}" for i in range(len(first + fillers))])
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_total_blocks and kv.host.num_pinned == 0
    assert len(kv.host) + len(kv.host._free) == kv.host.num_blocks
