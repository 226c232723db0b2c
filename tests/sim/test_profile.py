"""`tallyserve profile` measures a grid on the CPU with a tiny model; `simulate --hardware` loads it."""

from __future__ import annotations

import json

import pytest

from tallyserve.cli import main
from tallyserve.sim.cost_model import StepShape
from tallyserve.sim.profile_cost import ProfileCostModel


def test_profile_then_simulate(tiny_dir, tmp_path):
    prof = tmp_path / "profile.json"
    rc = main(["profile", "--model", tiny_dir, "--batch-sizes", "1,3", "--extra-tokens", "0,16",
               "--context-lens", "0,24", "--repeats", "1", "--num-gpu-blocks-override", "32", "--block-size", "4",
               "--output", str(prof), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(prof.read_text())
    assert data["device"] == "cpu" and data["batch_size"] == [1, 3] and data["context_len"] == [0, 24]
    assert all(t > 0 for plane in data["step_time_s"] for row in plane for t in row)
    pairs = [(t, h) for pt, ph in zip(data["step_time_s"], data["host_time_s"]) for rt, rh in zip(pt, ph)
             for t, h in zip(rt, rh)]
    assert len(pairs) == 8 and all(0 < h <= t for t, h in pairs)  # the host part of each measured step
    assert all(t > 0 for plane in data["step_time_s"] for row in plane for t in row)
    assert all(t > 0 for plane in data["stream_time_s"] for row in plane for t in row)  # back to back, async
    split = data["prefill_split"]  # the largest chunk (17 tokens) as 1, 2, 4 and 8 requests
    assert split["tokens"] == 17 and split["requests"] == [1, 2, 4, 8] and len(split["step_time_s"]) == 4
    assert split["extra_attn_pairs"] == sorted(split["extra_attn_pairs"], reverse=True)
    assert data["prefill_pair_time_s"] >= 0
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--model-config", tiny_dir, "--hardware", str(prof), "--workload", "random",
               "--num-requests", "12", "--random-input-len", "20", "--random-output-len", "5",
               "--num-gpu-blocks-override", "64", "--block-size", "4", "--disable-tqdm", "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["simulator"]["cost_model"] == "profile:cpu"
    assert result["duration_s"] > 0 and result["p50_itl_ms"] > 0


def test_profile_rejects_grid_beyond_max_model_len(tiny_dir, tmp_path):
    rc = main(["profile", "--model", tiny_dir, "--batch-sizes", "1", "--extra-tokens", "0,500",
               "--context-lens", "0,100", "--num-gpu-blocks-override", "200", "--output", str(tmp_path / "p.json")])
    assert rc == 2


def test_noisy_profile_never_gets_cheaper_past_the_grid():
    profile = {"batch_size": [1, 8], "extra_tokens": [0, 64], "context_len": [0],
               "step_time_s": [[[0.010], [0.012]], [[0.009], [0.020]]]}  # batch 8 measured faster: noise
    cost = ProfileCostModel(profile)
    shape = lambda b, e: StepShape(b + e, b, b, b, 0, 0)  # noqa: E731
    assert cost.step_time(shape(64, 0)) == pytest.approx(0.009)  # flat, not negative, past the edge
    assert cost.step_time(shape(8, 640)) == pytest.approx(0.020 + 9 * 0.011)
    assert cost.step_time(shape(4, 32)) == pytest.approx((0.011 * 4 + 0.0145 * 3) / 7)


def test_async_scheduling_overlaps_the_host_part():
    """Sync: a step costs what it measured. Async: its host part hides behind the device part of
    the step before, so it costs max(host, total - host); a profile without host times stays as is."""
    profile = {"batch_size": [1, 8], "extra_tokens": [0], "context_len": [0],
               "step_time_s": [[[0.010]], [[0.030]]], "host_time_s": [[[0.007]], [[0.004]]]}
    shape = lambda b: StepShape(b, b, b, b, 0, 0)  # noqa: E731
    cost = ProfileCostModel(profile)
    assert cost.step_time(shape(1)) == pytest.approx(0.010)
    cost.async_scheduling = True
    assert cost.step_time(shape(1)) == pytest.approx(0.007)  # host-bound: 7 ms > 10 - 7
    assert cost.step_time(shape(8)) == pytest.approx(0.026)  # device-bound: 30 - 4
    assert cost.step_time(shape(4)) == pytest.approx(0.007 + (0.026 - 0.007) * 3 / 7)
    del profile["host_time_s"]
    old = ProfileCostModel(profile)
    old.async_scheduling = True
    assert old.step_time(shape(8)) == pytest.approx(0.030)
    with pytest.raises(ValueError, match="host_time_s"):
        ProfileCostModel({**profile, "host_time_s": [[[0.1]]]})


def test_simulator_tells_the_profile_its_mode():
    from tallyserve.config import EngineArgs
    from tallyserve.sim.cli import engine_config_for, load_model_config
    from tallyserve.sim.simulator import SimOptions, Simulator

    profile = {"batch_size": [1], "extra_tokens": [0], "context_len": [0], "step_time_s": [[[0.01]]],
               "host_time_s": [[[0.004]]]}
    config = engine_config_for(EngineArgs(num_gpu_blocks_override=64, block_size=8), load_model_config("llama-3-8b"),
                               141e9)
    for mode in (True, False):
        cost = ProfileCostModel(profile)
        Simulator(config, cost, SimOptions(async_scheduling=mode))
        assert cost.async_scheduling is mode


def test_async_stream_time_and_a_step_launched_with_nothing_in_flight():
    """With a measured stream period, a step launched while another runs costs max(host, period);
    one launched with nothing in flight (the run's first, or the first after an idle gap) pays its
    host and device parts in turn: its measured total."""
    profile = {"batch_size": [1, 8], "extra_tokens": [0], "context_len": [0],
               "step_time_s": [[[0.010]], [[0.030]]], "host_time_s": [[[0.004]], [[0.004]]],
               "stream_time_s": [[[0.007]], [[0.0265]]]}
    shape = lambda b: StepShape(b, b, b, b, b, b)  # noqa: E731
    cost = ProfileCostModel(profile)
    cost.async_scheduling = True
    assert cost.step_time(shape(1)) == pytest.approx(0.007)
    assert cost.step_time(shape(8)) == pytest.approx(0.0265)
    assert cost.step_time(shape(1), overlapped=False) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="stream_time_s"):
        ProfileCostModel({**profile, "stream_time_s": [[[0.1]]]})


def test_simulator_prices_a_step_after_idle_at_its_total():
    """Async simulation: a request's first step starts from an idle engine (nothing in flight), so
    its first token comes after the step's measured total; the steps after it run in the stream."""
    from tallyserve.bench.workloads import RequestSpec, Workload
    from tallyserve.config import EngineArgs
    from tallyserve.sim.cli import engine_config_for, load_model_config
    from tallyserve.sim.simulator import SimOptions, Simulator

    profile = {"batch_size": [1], "extra_tokens": [0], "context_len": [0], "step_time_s": [[[0.010]]],
               "host_time_s": [[[0.004]]], "stream_time_s": [[[0.007]]]}
    config = engine_config_for(EngineArgs(num_gpu_blocks_override=64, block_size=8), load_model_config("llama-3-8b"),
                               141e9)
    work = Workload("t", [RequestSpec("a", 3, prompt_token_ids=[20, 21, 22, 23, 24], arrival_s=0.0),
                          RequestSpec("b", 3, prompt_token_ids=[30, 31, 32], arrival_s=1.0)])
    res = Simulator(config, ProfileCostModel(profile), SimOptions(async_scheduling=True)).run(work)
    for rec in res.records:
        assert rec.ttft_s == pytest.approx(0.010)  # the first step after idle: host + device in turn
        assert rec.latency_s == pytest.approx(0.010 + 2 * 0.007)  # two more steps, each behind the one before
    sync = Simulator(config, ProfileCostModel(profile), SimOptions(async_scheduling=False)).run(work)
    assert [r.latency_s for r in sync.records] == pytest.approx([0.030, 0.030])
