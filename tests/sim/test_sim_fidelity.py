"""benchmarks/sim_fidelity.py and run_requests(record_steps=True) on the CPU with a tiny model: the
recorded steps are the engine's (every launched step, its rows, its period), the cost model prices
each of them, and the simulator's own schedule of the same trace matches the engine's step by step."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tallyserve import LLM
from tallyserve.config import EngineArgs

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ARGS = dict(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=80,
            async_scheduling=True)


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import h200_runs
        import sim_fidelity

        yield h200_runs, sim_fidelity
    finally:
        sys.path.remove(str(BENCH))


def test_recorded_steps_priced_and_the_simulator_schedules_the_same(tiny_dir, tmp_path, bench_modules):
    h200_runs, sim_fidelity = bench_modules
    from tallyserve.profile import run_profile
    from tallyserve.sim.profile_cost import ProfileCostModel

    llm = LLM(model=tiny_dir, **ARGS)
    engine = llm.engine
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 30, 12, 21, 3, 17))]
    res = h200_runs.run_requests(engine, prompts, 5, time.perf_counter() + 600, "offline", record_steps=True)
    assert "_launch" not in vars(engine.core) and "_complete" not in vars(engine.core)  # the methods again
    steps = res["steps"]
    assert sum(s["tokens"] for s in steps) == res["stats"]["scheduled_tokens"]
    assert [s["overlapped"] for s in steps] == [False] + [True] * (len(steps) - 1)  # async: one step in flight
    assert all(s["period_ms"] > 0 and s["launch_ms"] > 0 for s in steps)
    assert [s["done_s"] for s in steps] == sorted(s["done_s"] for s in steps)
    assert {s["kind"] for s in steps} >= {"prefill", "decode"}
    assert steps[0]["kind"] == "prefill" and steps[0]["prefill_tokens"] == 24  # the budget, all prompt tokens
    assert len(res["ttft_s"]) == 6 and all(0 < t < res["wall_s"] for t in res["ttft_s"])

    profile = run_profile(engine, [1, 4], [0, 16], [0, 32], repeats=1, progress=False)
    cost = ProfileCostModel(profile, engine.model_config)
    cost.async_scheduling = True
    report = sim_fidelity.step_report(steps, cost, res["add_s"])
    assert all(s["predicted_ms"] > 0 for s in steps)
    assert sum(v["steps"] for v in report["by_kind"].values()) == len(steps)
    assert report["timeline"]["end"]["step"] == len(steps) - 1

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"request_id": f"mixed-{i}", "prompt_token_ids": p, "max_tokens": 5,
                                         "arrival_s": 0.0}) + "\n" for i, p in enumerate(prompts)))
    sim_res, sim = sim_fidelity.simulate_trace(trace, profile, tiny_dir, True, EngineArgs(**ARGS))
    diff = sim_fidelity.schedule_diff(steps, sim_res.steps, "offline-", "mixed-")
    assert diff == {"engine_steps": len(steps), "sim_steps": len(steps), "differing_steps": 0, "first_difference": None}
    assert sim_fidelity.config_diff(dict(sim.config.scheduler_config.__dict__),
                                    dict(engine.config.scheduler_config.__dict__)) == {}
    errors = sim_fidelity.ttft_errors(res["ttft_s"], [r.ttft_s for r in sim_res.records])
    assert errors["requests"] == 6 and set(errors["p50"]) == {"measured_ms", "sim_ms", "err_pct"}


def test_schedule_diff_names_the_first_differing_step(bench_modules):
    _, sim_fidelity = bench_modules
    real = [{"rows": [("offline-0", 8, 0), ("offline-1", 4, 0)]}, {"rows": [("offline-0", 1, 8)]}]
    same = [(((("mixed-0", 8, 0), ("mixed-1", 4, 0))), None), ((("mixed-0", 1, 8),), None)]
    assert sim_fidelity.schedule_diff(real, same, "offline-", "mixed-")["first_difference"] is None
    other = [same[0], ((("mixed-1", 1, 4),), None)]
    assert sim_fidelity.schedule_diff(real, other, "offline-", "mixed-")["first_difference"] == 1
    assert sim_fidelity.schedule_diff(real, same[:1], "offline-", "mixed-") == {
        "engine_steps": 2, "sim_steps": 1, "differing_steps": 1, "first_difference": 1}


def test_run_requests_steps_with_the_heap_frozen(tiny_dir, bench_modules):
    """As the engine's own loops do (engine/gc_heap.py): a full collection of the engine's heap in
    the middle of a measured run stalled the host 142-256 ms on the H200 (s12), which the simulator
    rightly never predicts. Collections that still run are noted."""
    import gc

    h200_runs, _ = bench_modules
    engine = LLM(model=tiny_dir, **ARGS).engine
    frozen_during_steps, step = [], engine.step

    def step_noting_the_heap():
        frozen_during_steps.append(gc.get_freeze_count() > 0)
        if len(frozen_during_steps) == 1:
            gc.collect()  # one collection inside the loop: noted
        return step()

    engine.step = step_noting_the_heap
    callbacks = list(gc.callbacks)
    res = h200_runs.run_requests(engine, [[3, 4, 5, 6], [7, 8, 9]], 3, time.perf_counter() + 600, "gc")
    del engine.step
    assert frozen_during_steps and all(frozen_during_steps)
    assert gc.get_freeze_count() == 0 and gc.callbacks == callbacks  # as it was before the run
    assert any(p["gen"] == 2 and p["ms"] >= 0 for p in res["gc_pauses"])
