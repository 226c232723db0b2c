"""The roofline matches hand-computed H200 numbers; a profile interpolates its grid exactly."""

from __future__ import annotations

import json

import pytest

from tallyserve.sim.cli import load_model_config
from tallyserve.sim.cost_model import HARDWARE, ModelShape, RooflineCostModel, StepShape, load_cost_model
from tallyserve.sim.profile_cost import ProfileCostModel, grid_extra_attn_pairs


def _shape(tokens, requests, ctx, sampled=None):
    pairs = ctx * tokens + tokens * (tokens + 1) // 2 if requests == 1 else tokens * ctx
    return StepShape(tokens, requests, requests if tokens == requests else 0, requests if sampled is None else sampled,
                     requests * ctx + (tokens if requests == 1 else 0), pairs)


def test_llama8b_roofline():
    mc = load_model_config("llama-3-8b")
    m = ModelShape.of(mc)
    assert m.linear_params + m.lm_head_params + m.embed_params == pytest.approx(8.03e9, rel=0.01)
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    cost = RooflineCostModel(mc, HARDWARE["h200"])
    hw = HARDWARE["h200"]
    overhead = hw.step_overhead_s + hw.per_request_overhead_s
    # One decode token: memory bound, about 15 GB of weights (embeddings are not read) at 4.27 TB/s.
    decode = cost.step_time(_shape(1, 1, 0)) - overhead
    assert decode == pytest.approx(2 * (m.linear_params + m.lm_head_params) / 4.27e12, rel=0.01)
    assert 3.3e-3 < decode < 3.8e-3
    # A 4096-token prefill is compute bound: 2 * params * tokens at 700 TFLOP/s, plus attention.
    prefill = cost.step_time(_shape(4096, 1, 0)) - overhead
    assert prefill == pytest.approx(2 * m.linear_params * 4096 / 700e12 + 2 * m.lm_head_params / 700e12
                                    + m.attn_flops_per_pair * (4096 * 4097 // 2) / 700e12, rel=1e-6)
    # Long contexts make decode rows read more KV.
    assert cost.step_time(_shape(64, 64, 4000)) > cost.step_time(_shape(64, 64, 100)) * 1.5


def _profile():
    axes = {"batch_size": [1, 4], "extra_tokens": [0, 100], "context_len": [0, 1000]}

    def f(b, e, c):
        return 0.001 + 0.0001 * b + 0.00002 * e + 0.000003 * c

    table = [[[f(b, e, c) for c in axes["context_len"]] for e in axes["extra_tokens"]] for b in axes["batch_size"]]
    return dict(axes, step_time_s=table, device="cpu", memory_bytes=1e9), f


def test_profile_interpolates_and_extrapolates_linearly(tmp_path):
    profile, f = _profile()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    cost = load_cost_model(str(path), load_model_config("llama-3-8b"))
    assert isinstance(cost, ProfileCostModel) and cost.mem_bytes == 1e9
    for b, e, c in [(1, 0, 0), (4, 100, 1000), (2, 50, 300), (8, 400, 5000), (3, 10, 10)]:
        # b requests with c tokens cached each, computing b + e tokens: each attends its cache and its new tokens
        shape = StepShape(num_tokens=b + e, num_requests=b, num_decode_rows=0, num_sampled=b,
                          context_tokens=b * c + b + e, attn_pairs=0)
        assert cost.step_time(shape) == pytest.approx(f(b, e, c), rel=1e-9)


def test_profile_and_hardware_validation(tmp_path):
    mc = load_model_config("llama-3-8b")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batch_size": [1, 1], "extra_tokens": [0], "context_len": [0],
                               "step_time_s": [[[1.0]], [[1.0]]]}))
    with pytest.raises(ValueError, match="strictly increasing"):
        load_cost_model(str(bad), mc)
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"matmul_flops": 350e12, "mem_bandwidth": 2e12, "mem_bytes": 80e9}))
    half = load_cost_model(str(hw), mc)
    full = load_cost_model("h200", mc)
    assert half.step_time(_shape(4096, 1, 0)) > full.step_time(_shape(4096, 1, 0)) * 1.8
    with pytest.raises(ValueError, match="--hardware"):
        load_cost_model("a100-nope", mc)


def test_kv_moves_cost_host_link_and_device_copies():
    mc = load_model_config("mistral-nemo-12b")
    cost = RooflineCostModel(mc, HARDWARE["h200"])
    base = StepShape(1, 1, 1, 1, 100, 100)
    moved = StepShape(1, 1, 1, 1, 100, 100, host_transfer_tokens=1600, copy_tokens=10)
    per_token = 2 * 40 * 8 * 128 * 2
    extra = 1600 * per_token / 50e9 + 2 * 10 * per_token / 4.27e12
    assert cost.step_time(moved) - cost.step_time(base) == pytest.approx(extra, rel=1e-9)


def _decode_step(num_reqs, shared_blocks, own_blocks, bs=16):
    from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
    from tallyserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4)
    reqs = tuple(ScheduledRequest(f"r{i}", (5,), (shared_blocks + own_blocks) * bs - 1 - i,
                                  tuple(range(shared_blocks)) + tuple(1000 + i * own_blocks + j for j in range(own_blocks)),
                                  True, params, 1) for i in range(num_reqs))
    return SchedulerOutput(step_id=1, requests=reqs, total_tokens=num_reqs)


def test_cascade_attention_reads_a_shared_prefix_once():
    """Decode rows over a prefix they all share (cascade attention on the GPU): the step reads that
    prefix's KV once, so the roofline prices (requests - 1) x prefix fewer KV tokens; the same step
    without cascade, or with too few rows, is priced as before."""
    mc = load_model_config("llama-3-8b")
    so = _decode_step(10, shared_blocks=20, own_blocks=3)
    plain, cascade = StepShape.of(so), StepShape.of(so, 16, cascade=True)
    assert plain.shared_prefix_tokens == 0 and cascade.shared_prefix_tokens == 320
    assert cascade.kv_read_tokens == plain.context_tokens - 9 * 320 == plain.kv_read_tokens - 2880
    assert StepShape.of(_decode_step(7, 20, 3), 16, cascade=True).shared_prefix_tokens == 0  # under 8 rows
    assert StepShape.of(_decode_step(10, 15, 3), 16, cascade=True).shared_prefix_tokens == 0  # under 256 tokens
    cost = RooflineCostModel(mc, HARDWARE["h200"])
    saved = cost.step_time(plain) - cost.step_time(cascade)
    assert saved == pytest.approx(2880 * ModelShape.of(mc).kv_bytes_per_token / HARDWARE["h200"].mem_bandwidth,
                                  rel=1e-9)


GRID = {"batch_size": [1, 4, 16], "extra_tokens": [0, 96, 512], "context_len": [0, 64, 300]}


def _grid_profile(f, **extra):
    table = [[[f(b, e, c) for c in GRID["context_len"]] for e in GRID["extra_tokens"]] for b in GRID["batch_size"]]
    return dict(GRID, step_time_s=table, device="test", **extra)


def test_grid_steps_price_at_their_own_measurement():
    """A step shaped like a grid point (what `tallyserve profile` timed there) costs that point's
    time: its context coordinate is the KV cached before the step, not counting its own tokens."""
    from tallyserve.profile import grid_step

    def f(b, e, c):  # anything: an exact grid point needs no interpolation
        return 0.002 + 0.001 * ((7 * b + 3 * e + c) % 11)

    for extra in ({}, {"prefill_pair_time_s": 3e-9}):
        cost = ProfileCostModel(_grid_profile(f, **extra))
        for b in GRID["batch_size"]:
            for e in GRID["extra_tokens"]:
                for c in GRID["context_len"]:
                    shape = StepShape.of(grid_step(b, e, c, 16, 1000))
                    assert shape.cached_len == c and shape.num_tokens - shape.num_requests == e
                    assert shape.extra_attn_pairs == grid_extra_attn_pairs(e, c)
                    assert cost.step_time(shape) == pytest.approx(f(b, e, c), rel=1e-12), (b, e, c, extra)


def _mixed_step(rows):
    """A SchedulerOutput of (new tokens, cached tokens) rows."""
    from tallyserve.profile import rows_output

    return rows_output(rows, 16, 10_000)


def test_prefill_attention_is_priced_by_the_step_own_pairs():
    """The grid's extra tokens are one request's chunk (attention quadratic in its length). A step
    whose prefill tokens are several short prompts attends far fewer pairs: with the profile's
    measured seconds per pair, the grid's pairs are priced out and the step's own priced in."""
    alpha, per_token, per_kv, per_pair = 2e-3, 20e-6, 50e-9, 40e-9

    def f(b, e, c):  # linear costs plus the grid step's own prefill attention
        return alpha + per_token * (b + e) + per_kv * b * c + per_pair * grid_extra_attn_pairs(e, c)

    steps = [
        [(200, 0), (150, 0), (90, 0)],  # pure prefill: three prompts
        [(120, 0), (60, 40)] + [(1, 250)] * 6,  # two chunks (one over a cached prefix) and six decode rows
        [(1, 10), (1, 200), (1, 290)],  # decode only
        [(300, 0), (250, 0)] + [(1, 100)] * 12,  # past the extra-tokens edge: linear in the tokens
    ]
    cost = ProfileCostModel(_grid_profile(f, prefill_pair_time_s=per_pair))
    plain = ProfileCostModel(_grid_profile(f))
    for rows in steps:
        s = StepShape.of(_mixed_step(rows))
        want = alpha + per_token * s.num_tokens + per_kv * s.num_requests * s.cached_len + per_pair * s.extra_attn_pairs
        assert cost.step_time(s) == pytest.approx(want, rel=1e-9), rows
        if any(n > 1 for n, _ in rows):  # without the rate the grid's one long chunk is charged
            assert plain.step_time(s) > want * 1.05, rows
    with pytest.raises(ValueError, match="prefill_pair_time_s"):
        ProfileCostModel(_grid_profile(f, prefill_pair_time_s=-1.0))


def test_fp8_prices_half_the_projection_bytes_twice_the_rate_and_half_the_kv():
    mc = load_model_config("llama-3-8b")
    bf16, fp8 = ModelShape.of(mc), ModelShape.of(mc, fp8_weights=True, fp8_kv_cache=True)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.weight_bytes == bf16.linear_params + 2 * (bf16.lm_head_params + bf16.embed_params)
    hw = HARDWARE["h100"]
    base, quant = RooflineCostModel(mc, hw), RooflineCostModel(mc, hw, fp8_weights=True, fp8_kv_cache=True)
    assert quant.name == "roofline:h100+fp8+fp8kv"
    overhead = hw.step_overhead_s + hw.per_request_overhead_s
    # one decode token: the bytes of the FP8 projections and the bf16 lm_head
    decode = quant.step_time(_shape(1, 1, 0)) - overhead
    assert decode == pytest.approx((bf16.linear_params + 2 * bf16.lm_head_params) / hw.mem_bandwidth, rel=0.01)
    assert decode < 0.56 * (base.step_time(_shape(1, 1, 0)) - overhead)
    # a long prefill: the projections at the FP8 rate (2x bf16 unless the hardware names it), lm_head at bf16
    prefill = quant.step_time(_shape(4096, 1, 0)) - overhead
    assert prefill == pytest.approx(2 * fp8.linear_params * 4096 / (2 * hw.matmul_flops)
                                    + 2 * fp8.lm_head_params / hw.matmul_flops
                                    + fp8.attn_flops_per_pair * (4096 * 4097 // 2) / hw.matmul_flops, rel=1e-6)


def test_simulate_sizes_the_pool_for_fp8(tmp_path):
    from tallyserve.config import EngineArgs
    from tallyserve.sim.cli import num_sim_blocks

    mc = load_model_config("llama-3-8b")
    hw = HARDWARE["h100"]
    plain = num_sim_blocks(EngineArgs(), mc, hw.mem_bytes)
    fp8 = num_sim_blocks(EngineArgs(quantization="fp8", kv_cache_dtype="fp8"), mc, hw.mem_bytes)
    weights = ModelShape.of(mc).weight_bytes
    saved = weights - ModelShape.of(mc, fp8_weights=True).weight_bytes
    assert fp8 == int((hw.mem_bytes * 0.9 - weights + saved) // (ModelShape.of(mc).kv_bytes_per_token * 16 // 2))
    assert fp8 > 2 * plain


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9),
                                               ("qwen3-coder-480b-a35b", 480e9, 35e9)])
def test_mixture_of_experts_counts_every_expert_stored_and_top_k_computed(name, total, active):
    """The published sizes: parameters stored, parameters a token computes."""
    m = ModelShape.of(load_model_config(name))
    assert m.linear_params + m.lm_head_params + m.embed_params == pytest.approx(total, rel=0.02)
    assert m.active_params + m.lm_head_params + m.embed_params == pytest.approx(active, rel=0.03)


def test_mixture_of_experts_reads_the_experts_its_tokens_reach():
    mc = load_model_config("qwen3-30b-a3b")
    m = ModelShape.of(mc)
    experts = m.num_moe_layers * m.experts_per_rank * m.expert_params
    dense = m.linear_params - experts
    assert m.read_params(1) == pytest.approx(dense + experts * 8 / 128, rel=1e-6)  # one token: its 8 experts
    assert m.read_params(256) == pytest.approx(dense + experts * (1 - (120 / 128) ** 256), rel=1e-6)  # ~all
    hw = HARDWARE["h100"]
    cost = RooflineCostModel(mc, hw)
    overhead = hw.step_overhead_s + hw.per_request_overhead_s
    decode = cost.step_time(_shape(1, 1, 0)) - overhead
    assert decode == pytest.approx(2 * (m.read_params(1) + m.lm_head_params) / hw.mem_bandwidth, rel=0.01)
    # expert parallelism: each rank holds a quarter of the experts whole, and computes a quarter on average
    ep = ModelShape.of(mc, 4, expert_parallel=True)
    tp = ModelShape.of(mc, 4)
    assert ep.experts_per_rank == 32 and tp.experts_per_rank == 128
    assert ep.linear_params == pytest.approx(tp.linear_params, rel=0.01)
    assert ep.active_params == pytest.approx(tp.active_params, rel=0.01)
    assert ep.read_params(1) == pytest.approx(tp.read_params(1), rel=0.01)  # on average the same bytes per rank


def test_simulate_refuses_experts_that_do_not_split():
    from tallyserve.config import EngineArgs
    from tallyserve.sim.cli import engine_config_for

    mc = load_model_config("mixtral-8x7b")
    with pytest.raises(ValueError, match=r"^enable_expert_parallel: 8 experts are not divisible by "
                                         r"tensor_parallel_size=16"):
        engine_config_for(EngineArgs(tensor_parallel_size=16, enable_expert_parallel=True), mc, 141e9)
