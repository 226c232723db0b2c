#!/usr/bin/env python3
"""Inter-token latency vs vLLM's partial prefill knobs, in the simulator (virtual time, no GPU).

    python3 benchmarks/itl_knobs_sim.py [--model-config llama-3-8b] [--hardware h200]
                                        [--num-requests 256] [--output-len 256] [--json PATH]

The workload is h200_bench.py's "mixed" one: 256 requests arriving at once, prompts uniform in
[256, 1024] tokens (random ids, numpy seed 0), 256 new tokens each (ignore_eos). Each setting runs the
real Scheduler + KV cache manager on the roofline cost model of the model's shape on one H200 (async
scheduling on, as on a GPU), and the ledger is checked every step. Settings: the defaults, then
long_prefill_token_threshold 512 / 1024 / 2048 with max_num_partial_prefills 2 / 4 (vLLM's default
max_long_partial_prefills=1, then max_long_partial_prefills = max_num_partial_prefills), and for
reference a smaller max_num_batched_tokens. Prints one table: output throughput, TTFT p50 / p99,
ITL p99 (the gap between a request's consecutive tokens), and the largest step (tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tallyserve.bench.metrics import summarize  # noqa: E402
from tallyserve.bench.workloads import RequestSpec, Workload  # noqa: E402
from tallyserve.config import EngineArgs  # noqa: E402
from tallyserve.sim.cli import engine_config_for, load_model_config  # noqa: E402
from tallyserve.sim.cost_model import load_cost_model  # noqa: E402
from tallyserve.sim.simulator import SimOptions, Simulator  # noqa: E402


def mixed_workload(vocab: int, num_requests: int, output_len: int) -> Workload:
    """h200_bench.py's mixed prompts: lengths uniform in [256, 1024], random ids, seed 0."""
    rng = np.random.default_rng(0)
    lens = rng.integers(256, 1024 + 1, size=num_requests)
    specs = [RequestSpec(f"mixed-{i}", output_len, prompt_token_ids=rng.integers(0, vocab, size=int(n)).tolist(),
                         arrival_s=0.0) for i, n in enumerate(lens)]
    return Workload("mixed", specs)


def settings() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("defaults", {})]
    for n_long in ("1", "N"):
        for threshold in (512, 1024, 2048):
            for n in (2, 4):
                label = f"thr={threshold} N={n} long={n if n_long == 'N' else 1}"
                out.append((label, dict(long_prefill_token_threshold=threshold, max_num_partial_prefills=n,
                                        max_long_partial_prefills=n if n_long == "N" else 1)))
    out.append(("ref: budget=2048", dict(max_num_batched_tokens=2048)))
    out.append(("ref: budget=2048 thr=512 N=4 long=4", dict(max_num_batched_tokens=2048, long_prefill_token_threshold=512,
                                                          max_num_partial_prefills=4, max_long_partial_prefills=4)))
    return out


def run_one(model_config: str, hardware: str, workload_args: tuple, overrides: dict) -> dict:
    mc = load_model_config(model_config)
    cost = load_cost_model(hardware, mc)
    config = engine_config_for(EngineArgs(**overrides), mc, cost.mem_bytes)
    workload = mixed_workload(mc.vocab_size, *workload_args)
    res = Simulator(config, cost, SimOptions(record_steps=True)).run(workload)
    summary = summarize(res.records, res.duration_s)
    ledger = res.stats["ledger"]
    if summary["errors"] or not ledger["exact"]:
        raise SystemExit(f"{overrides}: errors {summary['error_kinds']} or ledger not exact {ledger}")
    return {
        "overrides": overrides,
        "steps": res.stats["steps"],
        "duration_s": summary["duration_s"],
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "p50_ttft_ms": summary["p50_ttft_ms"],
        "p99_ttft_ms": summary["p99_ttft_ms"],
        "p50_itl_ms": summary["p50_itl_ms"],
        "p99_itl_ms": summary["p99_itl_ms"],
        "max_step_tokens": max(sum(n for _, n, _ in step) for step, _ in res.steps),
        "max_num_batched_tokens": ledger["max_num_batched_tokens"],
        "wall_s": round(res.wall_s, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="llama-3-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ns = ap.parse_args()

    rows = []
    t0 = time.perf_counter()
    for label, overrides in settings():
        row = run_one(ns.model_config, ns.hardware, (ns.num_requests, ns.output_len), overrides)
        row["setting"] = label
        rows.append(row)
        print(f"  {label}: {row['wall_s']} s wall", file=sys.stderr, flush=True)

    print(f"\n{ns.model_config} on {ns.hardware} (simulated, virtual time): {ns.num_requests} requests at once, "
          f"prompts 256-1024, {ns.output_len} new tokens; async scheduling; ledger exact in every run\n")
    head = ("setting", "budget", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "max step tok",
            "duration s")
    fmt = "| {:<36} | {:>6} | {:>9} | {:>11} | {:>11} | {:>10} | {:>10} | {:>12} | {:>10} |"
    print(fmt.format(*head))
    print("|" + "|".join("-" * (w + 2) for w in (36, 6, 9, 11, 11, 10, 10, 12, 10)) + "|")
    for r in rows:
        print(fmt.format(r["setting"], r["max_num_batched_tokens"], f"{r['output_throughput']:.0f}",
                         f"{r['p50_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}", f"{r['p50_itl_ms']:.1f}",
                         f"{r['p99_itl_ms']:.1f}", r["max_step_tokens"], f"{r['duration_s']:.2f}"))
    print(f"\n({time.perf_counter() - t0:.0f} s wall in all)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
