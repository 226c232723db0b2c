"""`tallyserve simulate`: replay a workload through the real scheduler on a virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from tallyserve.bench.workloads import add_workload_args, workload_from_args
from tallyserve.config import EngineArgs, EngineConfig
from tallyserve.config.model import ModelConfig
from tallyserve.config.args import add_engine_args as _add_engine_args
from tallyserve.sim.simulator import SimOptions, Simulator
from tallyserve.config.quantization import resolve_quantization
from tallyserve.sim.cost_model import load_cost_model
from tallyserve.config.args import engine_args_from
from tallyserve.bench.report import build_result, plot, print_report, write_json
from tallyserve.config.model import check_tensor_parallel
from tallyserve.sim.cost_model import ModelShape
from tallyserve.models.moe import check_expert_parallel

# Named scenarios: defaults for flags the user did not give.
SCENARIOS = {
    # The TensorRT-LLM #13318 setting: multi-turn chat at 7 requests/s on a 12B shape, a 4096-token
    # budget, chunked prefill, full and partial prefix reuse, a KV pool small enough to evict
    # (2048 blocks = 32k tokens), and a host tier (16 GiB) that evicted prefix blocks move to.
    "overload-replay": dict(
        workload="multi-turn", request_rate=7.0, num_requests=2000, model_config="mistral-nemo-12b",
        max_num_batched_tokens=4096, enable_chunked_prefill=True, enable_prefix_caching=True,
        enable_partial_reuse=True, num_gpu_blocks_override=2048, kv_offload_bytes=16 << 30, multi_turn_turns=8, multi_turn_user_len=200,
        multi_turn_system_len=512, random_output_len=200, random_range_ratio=0.5, think_time=2.0,
    ),
}


def load_model_config(name: str) -> ModelConfig:
    """A preset name (tallyserve/model_configs), a config.json, or a directory holding one."""
    from tallyserve.models.loader import PRESET_DIR, preset_names

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        if name not in preset_names():
            raise ValueError(f"--model-config {name!r} is neither a file nor a preset ({', '.join(preset_names())})")
        path = PRESET_DIR / f"{name}.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {str(path)!r}: {exc}") from None
    return ModelConfig.from_hf_config(cfg)


def fp8_flags(args: EngineArgs, mc: ModelConfig) -> tuple[bool, bool]:
    """(FP8 projections, FP8 KV cache) as the engine would run them: quantization="fp8" or an FP8 checkpoint's
    quantization_config; kv_cache_dtype="fp8"."""
    return (resolve_quantization(mc.hf_config, args.quantization) is not None,
            args.kv_cache_dtype in ("fp8", "fp8_e4m3"))


def sim_shape(args: EngineArgs, mc: ModelConfig) -> ModelShape:
    """One rank's shape as the engine would run it (``fp8_flags``, expert parallelism)."""
    return ModelShape.of(mc, args.tensor_parallel_size, *fp8_flags(args, mc), args.enable_expert_parallel)


def num_sim_blocks(args: EngineArgs, mc: ModelConfig, mem_bytes: float) -> int:
    """The override, else per rank: (device memory x gpu_memory_utilization - the rank's weights, about
    weights / tensor_parallel_size) / the rank's block (`kv_bytes_per_token` at tensor_parallel_size, as the
    runner sizes its pool; bf16, or FP8). kv_cache_memory_bytes is per rank too."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    tp = args.tensor_parallel_size
    shape = sim_shape(args, mc)
    per_block = shape.kv_bytes_per_token * args.block_size
    budget = args.kv_cache_memory_bytes or int(mem_bytes * args.gpu_memory_utilization) - shape.weight_bytes
    if budget < per_block:
        where = f"per GPU at tensor_parallel_size {tp}" if tp > 1 else "on one GPU"
        raise ValueError(f"the weights ({shape.weight_bytes / 1e9:.1f} GB {where}) leave no room for a KV "
                         f"block in {mem_bytes * args.gpu_memory_utilization / 1e9:.1f} GB (memory x "
                         f"gpu_memory_utilization); raise --tensor-parallel-size or gpu_memory_utilization")
    return int(budget // per_block)


def num_sim_host_blocks(args: EngineArgs, mc: ModelConfig) -> int:
    """Blocks of the host KV tier: kv_offload_bytes over one block of one rank (0: no tier)."""
    if not args.kv_offload_bytes or not args.enable_prefix_caching:
        return 0
    per_block = sim_shape(args, mc).kv_bytes_per_token * args.block_size
    return max(args.kv_offload_bytes // per_block, 1)


def engine_config_for(args: EngineArgs, mc: ModelConfig, mem_bytes: float) -> EngineConfig:
    """ValueError for bad arguments, a tensor_parallel_size the model cannot be split over
    (check_tensor_parallel, as the engine checks it), or weights that leave no KV block."""
    args.validate()
    if getattr(args, "speculative_config", None) is not None:
        raise ValueError("simulate does not model speculative decoding (drafts) yet; drop --speculative-config")
    check_tensor_parallel(mc, args.tensor_parallel_size)
    if mc.moe_layers:
        check_expert_parallel(mc.num_experts, args.tensor_parallel_size, args.enable_expert_parallel,
                              mc.moe_intermediate_size)
    if args.tensor_parallel_size > 1 and args.async_scheduling is None:
        # The engine steps synchronously under tensor parallelism (MultiprocExecutor.overlaps_host).
        args = dataclasses.replace(args, async_scheduling=False)
    return args.resolve(mc, num_sim_blocks(args, mc, mem_bytes), num_sim_host_blocks(args, mc))


def _apply_scenario(ns: argparse.Namespace) -> None:
    if ns.scenario is None:
        return
    for key, value in SCENARIOS[ns.scenario].items():
        if getattr(ns, key, None) is None:
            setattr(ns, key, value)


def _cmd_simulate(ns: argparse.Namespace) -> int:
    _apply_scenario(ns)
    name = ns.model_config or ns.model
    if name is None:
        raise ValueError("simulate needs --model-config (a preset, a config.json or a model directory)")
    mc = load_model_config(name)
    args = engine_args_from(ns)
    tp = args.tensor_parallel_size
    link = ns.link_bandwidth_gbs * 1e9 if ns.link_bandwidth_gbs is not None else None
    latency = ns.collective_latency_us * 1e-6 if ns.collective_latency_us is not None else None
    fp8_weights, fp8_kv = fp8_flags(args, mc)
    cost = load_cost_model(ns.hardware, mc, tp, link_bandwidth=link, collective_latency_s=latency,
                           fp8_weights=fp8_weights, fp8_kv_cache=fp8_kv, expert_parallel=args.enable_expert_parallel)
    config = engine_config_for(args, mc, cost.mem_bytes)
    workload = workload_from_args(ns, seed=ns.seed or 0)
    opts = SimOptions(max_concurrency=ns.max_concurrency, integrity_every=ns.integrity_every,
                      build_batches=ns.build_batches, progress=not ns.disable_tqdm)
    sim = Simulator(config, cost, opts)
    res = sim.run(workload)
    sc, cc = config.scheduler_config, config.cache_config
    run_config = {
        "scenario": ns.scenario, "model_config": name, "hardware": ns.hardware, "cost_model": cost.name,
        "tensor_parallel_size": tp, "max_concurrency": ns.max_concurrency, "workload": workload.options,
        "scheduler": sc.__dict__, "cache": cc.__dict__,
    }
    extra = {"simulator": dict(res.stats, wall_s=round(res.wall_s, 3), **_tp_stats(cost, tp))}
    result = build_result("tallyserve simulate", run_config, res.records, res.duration_s, extra)
    print_report(result, title=f"tallyserve simulate: {workload.name} on {cost.name} (virtual time)")
    if ns.output:
        write_json(result, ns.output)
    if ns.plot:
        plot(result, res.records, ns.plot)
    return 0 if result["errors"] == 0 and res.stats["ledger"]["violations"] == 0 else 1


def _tp_stats(cost, tp: int) -> dict:
    """Tensor parallelism in the report: the size, and the share of the busy time in collectives."""
    busy, comm = getattr(cost, "busy_s", 0.0), getattr(cost, "comm_s", 0.0)
    out = {"tensor_parallel_size": tp, "comm_s": round(comm, 6), "comm_share": round(comm / busy, 6) if busy else 0.0}
    hw = getattr(cost, "hw", None)
    if tp > 1 and hw is not None:
        out["link_bandwidth_gbs"] = round(hw.link_bandwidth / 1e9, 3)
        out["collective_latency_us"] = round(hw.collective_latency_s * 1e6, 3)
    return out


def register(sub) -> None:
    p = sub.add_parser("simulate", help="replay a workload through the real scheduler with a cost model",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help="named scenario: defaults for every flag not given")
    p.add_argument("--model-config", default=None, help="preset name, config.json, or model directory")
    p.add_argument("--hardware", default="h200", help="h200, h100, a hardware JSON, or a profile JSON")
    p.add_argument("--link-bandwidth-gbs", type=float, default=None,
                   help="tensor parallelism: GPU-to-GPU all-reduce bus bandwidth in GB/s (default: the hardware's, "
                        "360 for the H200's NVLink)")
    p.add_argument("--collective-latency-us", type=float, default=None,
                   help="tensor parallelism: fixed cost of one collective in microseconds (default: the hardware's, "
                        "15 for the H200)")
    p.add_argument("--max-concurrency", type=int, default=None, help="client side: most requests in flight")
    p.add_argument("--integrity-every", type=int, default=None,
                   help="steps between KV integrity checks (default: adaptive, about 10%% of the wall time)")
    p.add_argument("--build-batches", action="store_true", help="build the real ForwardBatch each step (slow)")
    p.add_argument("--output", default=None, help="write the full record as JSON here")
    p.add_argument("--plot", default=None, help="write latency distributions and throughput as a PNG here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_workload_args(p, with_seed=False)  # --seed is the engine argument, used for both
    _add_engine_args(p)
    p.set_defaults(func=_cmd_simulate)
