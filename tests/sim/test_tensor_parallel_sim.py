"""`simulate --tensor-parallel-size N`: one rank's share of the roofline plus the collectives, a KV
pool sized per rank, the model-side split rule, and a 70B shape that needs 4 GPUs."""

from __future__ import annotations

import json

import pytest

from tallyserve.cli import main
from tallyserve.config import EngineArgs
from tallyserve.config.model import kv_bytes_per_token
from tallyserve.sim.cli import engine_config_for, load_model_config
from tallyserve.sim.cost_model import HARDWARE, ModelShape, RooflineCostModel, StepShape, load_cost_model

H200 = HARDWARE["h200"]
BW, LAT = H200.link_bandwidth, H200.collective_latency_s


def _decode(batch=64, ctx=1000):
    return StepShape(batch, batch, batch, batch, batch * ctx, batch * ctx)


def _prefill(tokens=8192):
    return StepShape(tokens, 1, 0, 1, tokens, tokens * (tokens + 1) // 2)


def _expected_comm(mc, tp, s):
    """2 all-reduces per layer + 1 after the embedding, of tokens x hidden bf16; the logits gather."""
    ar = 2 * (tp - 1) / tp * s.num_tokens * mc.hidden_size * 2 / BW + LAT
    padded_vocab = -(-mc.vocab_size // tp) * tp
    gather = (tp - 1) / tp * s.num_sampled * padded_vocab * 2 / BW + LAT
    return (2 * mc.num_hidden_layers + 1) * ar + gather


def test_shard_is_one_nth_and_tp1_unchanged():
    mc = load_model_config("llama-3-8b")
    one, two = ModelShape.of(mc), ModelShape.of(mc, 2)
    assert one == ModelShape.of(mc, 1) and one.num_all_reduces == 0
    assert two.weight_bytes * 2 == one.weight_bytes  # every split of llama-3-8b is exact at 2
    assert two.attn_flops_per_pair * 2 == one.attn_flops_per_pair
    assert two.kv_bytes_per_token == kv_bytes_per_token(mc, 2, 2) == one.kv_bytes_per_token // 2
    # 8 KV heads over 16 ranks: each rank holds one (replicated) head, 1/8 of the KV, not 1/16.
    sixteen = ModelShape.of(mc, 16)
    assert sixteen.kv_bytes_per_token == one.kv_bytes_per_token // 8 == kv_bytes_per_token(mc, 2, 16)
    assert RooflineCostModel(mc, H200).comm_time(_decode()) == 0.0


def test_decode_step_gains_less_than_half_at_tp2():
    mc = load_model_config("llama-3-8b")
    t1 = RooflineCostModel(mc, H200, 1).step_time(_decode())
    c2 = RooflineCostModel(mc, H200, 2)
    t2 = c2.step_time(_decode())
    assert t1 / 2 < t2 < t1
    comm = c2.comm_time(_decode())
    assert comm == pytest.approx(_expected_comm(mc, 2, _decode()), rel=1e-12)
    assert comm > 0 and t2 - comm > t1 / 2 - H200.step_overhead_s  # the step overhead does not split
    assert c2.comm_s == pytest.approx(comm) and c2.busy_s == pytest.approx(t2)


@pytest.mark.parametrize("name,tp", [("llama-3-8b", 2), ("llama-3-70b", 4)])
def test_prefill_step_scales_close_to_one_nth(name, tp):
    """Compute bound: the matmuls split N ways; the all-reduces (not overlapped) cost under 25%."""
    mc = load_model_config(name)
    t1 = RooflineCostModel(mc, H200, 1).step_time(_prefill())
    cost = RooflineCostModel(mc, H200, tp)
    t = cost.step_time(_prefill())
    comm = cost.comm_time(_prefill())
    assert t1 / tp < t < 1.25 * t1 / tp
    assert t - comm == pytest.approx(t1 / tp, rel=0.02)  # the compute alone: 1/N (but the fixed step overhead)
    assert 0 < comm / t < 0.2


def test_all_reduce_time_grows_with_tokens():
    mc = load_model_config("llama-3-8b")
    cost = RooflineCostModel(mc, H200, 4)
    times = [cost.comm_time(StepShape(n, 1, 0, 1, n, n)) for n in (1, 16, 256, 4096)]
    assert times == sorted(times) and times[-1] > 10 * times[0]
    for n, t in zip((1, 16, 256, 4096), times):
        assert t == pytest.approx(_expected_comm(mc, 4, StepShape(n, 1, 0, 1, n, n)), rel=1e-12)


def test_kv_pool_per_rank_grows_with_tp():
    mc = load_model_config("llama-3-8b")
    mem, gmu = 141e9, 0.9
    full_weights = 2 * (32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 2 * 128256 * 4096)
    blocks = []
    for tp in (1, 2, 4, 8):
        config = engine_config_for(EngineArgs(tensor_parallel_size=tp), mc, mem)
        per_block = 2 * 32 * (8 // tp) * 128 * 2 * 16
        assert config.cache_config.num_blocks == (int(mem * gmu) - full_weights // tp) // per_block
        blocks.append(config.cache_config.num_blocks)
    assert blocks == sorted(blocks) and blocks[1] > 2 * blocks[0]
    assert engine_config_for(EngineArgs(tensor_parallel_size=2), mc, mem).args.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        engine_config_for(EngineArgs(tensor_parallel_size=2, async_scheduling=True), mc, mem)


def test_70b_needs_four_h200s():
    mc = load_model_config("llama-3-70b")
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads,
            mc.intermediate_size, mc.vocab_size) == (8192, 80, 64, 8, 28672, 128256)
    weights = ModelShape.of(mc).weight_bytes
    assert weights == pytest.approx(141.1e9, rel=0.01)
    with pytest.raises(ValueError, match="leave no room for a KV block"):
        engine_config_for(EngineArgs(), mc, H200.mem_bytes)
    config = engine_config_for(EngineArgs(tensor_parallel_size=4), mc, H200.mem_bytes)
    per_block = 2 * 80 * 2 * 128 * 2 * 16
    assert config.cache_config.num_blocks == (int(141e9 * 0.9) - weights // 4) // per_block > 10_000


@pytest.mark.parametrize("tp,match", [
    (3, r"^tensor_parallel_size=3 does not fit LlamaForCausalLM: num_attention_heads \(32\) is not divisible by it"),
    (64, r"^tensor_parallel_size=64 does not fit LlamaForCausalLM: num_attention_heads \(32\) is not divisible"),
    (0, r"^tensor_parallel_size must be an integer >= 1, got 0"),
])
def test_bad_tensor_parallel_sizes(tp, match, capsys):
    mc = load_model_config("llama-3-8b")
    with pytest.raises(ValueError, match=match):
        load_cost_model("h200", mc, tp)
    with pytest.raises(ValueError, match=match):
        engine_config_for(EngineArgs(tensor_parallel_size=tp), mc, 141e9)
    rc = main(["simulate", "--model-config", "llama-3-8b", "-tp", str(tp), "--num-requests", "2", "--disable-tqdm"])
    assert rc == 2
    assert "tensor_parallel_size" in capsys.readouterr().err


def test_link_overrides_and_profile_refused(tmp_path):
    mc = load_model_config("llama-3-8b")
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"matmul_flops": 700e12, "mem_bandwidth": 4.27e12, "mem_bytes": 141e9,
                              "link_bandwidth": 50e9, "collective_latency_s": 0.0}))
    slow = load_cost_model(str(hw), mc, 2)
    assert slow.hw.link_bandwidth == 50e9
    assert slow.comm_time(_prefill()) > 5 * load_cost_model("h200", mc, 2).comm_time(_prefill())
    fast = load_cost_model("h200", mc, 2, link_bandwidth=1e15, collective_latency_s=0.0)
    assert fast.comm_time(_decode()) < 1e-6
    with pytest.raises(ValueError, match="link_bandwidth"):
        load_cost_model("h200", mc, 2, link_bandwidth=0.0)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"batch_size": [1], "extra_tokens": [0], "context_len": [0],
                                   "step_time_s": [[[0.01]]]}))
    assert load_cost_model(str(profile), mc, 1).name.startswith("profile:")
    with pytest.raises(ValueError, match="roofline"):
        load_cost_model(str(profile), mc, 2)


def _cli_70b(tmp_path, tp, *extra):
    out = tmp_path / f"sim{tp}.json"
    rc = main(["simulate", "--model-config", "llama-3-70b", "--tensor-parallel-size", str(tp), "--num-requests", "50",
               "--workload", "random", "--random-input-len", "200", "--random-output-len", "20",
               "--request-rate", "10", "--seed", "3", "--disable-tqdm", "--output", str(out), *extra])
    return rc, out


def test_cli_70b_at_tp4_end_to_end(tmp_path, capsys):
    rc, out = _cli_70b(tmp_path, 4)
    assert rc == 0
    report = capsys.readouterr().out
    assert "tensor_parallel_size" in report and "comm_share" in report
    result = json.loads(out.read_text())
    assert result["completed"] == result["num_requests"] == 50 and result["errors"] == 0
    sim = result["simulator"]
    assert result["config"]["tensor_parallel_size"] == sim["tensor_parallel_size"] == 4
    assert result["config"]["cost_model"] == "roofline:h200x4"
    assert 0.0 < sim["comm_share"] < 0.5 and sim["comm_s"] > 0
    assert sim["ledger"]["violations"] == 0 and sim["ledger"]["exact"] is True
    per_block = kv_bytes_per_token(load_model_config("llama-3-70b"), 2, 4) * 16
    weights = ModelShape.of(load_model_config("llama-3-70b"), 4).weight_bytes
    assert sim["kv"]["num_blocks"] == (int(141e9 * 0.9) - weights) // per_block
    # One H200 cannot hold it: a clear error, exit status 2.
    rc, _ = _cli_70b(tmp_path, 1)
    assert rc == 2 and "leave no room for a KV block" in capsys.readouterr().err
