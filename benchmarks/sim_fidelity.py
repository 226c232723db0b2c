#!/usr/bin/env python3
"""Where `tallyserve simulate` departs from the engine it models: the offline run's steps (as
`h200_runs.run_requests(record_steps=True)` records them) priced by the cost model one by one, the
simulator's own schedule of the same trace against the engine's, and TTFT request by request.

    python benchmarks/serving.py reprice DIR [--profile DIR/profile.json]

reads what `benchmarks/serving.py fidelity` wrote to DIR (offline_steps.json, profile.json, ttft.json,
mixed_trace.jsonl) and prints the comparison again with this checkout's cost model: no GPU needed.

A step's measured time is its period: when its results reached the host minus when the step
before's did (the first: minus the start of the step loop). Under async scheduling that is what
the simulator's clock advances by for it (`ProfileCostModel`: the stream period, or the total for a
step launched with nothing in flight).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KINDS = ("prefill", "mixed", "decode")
PERCENTILES = (10, 25, 50, 75, 90, 99)


def _pct(a: float, b: float) -> Optional[float]:
    return round(100.0 * (a - b) / b, 2) if b else None


def predict_steps(steps: list, cost) -> None:
    """Add ``predicted_ms`` to each step record: the cost model's time for its shape, launched as
    it was (with a step in flight or not)."""
    from tallyserve.sim.cost_model import StepShape

    for s in steps:
        shape = dict(s["shape"])
        if "max_seq_len" not in shape and s.get("rows"):  # recorded before StepShape had it
            shape["max_seq_len"] = max(n + start for _, n, start in s["rows"])
        s["predicted_ms"] = round(cost.step_time(StepShape(**shape), overlapped=s["overlapped"]) * 1e3, 3)


def by_kind(steps: list) -> dict:
    """Measured against predicted time per kind of step (pure prefill, prefill chunks with decode
    rows, pure decode): totals, their error, and the median error of single steps."""
    out = {}
    for kind in KINDS:
        rows = [s for s in steps if s["kind"] == kind and s.get("period_ms") is not None]
        if not rows:
            continue
        real = sum(s["period_ms"] for s in rows) / 1e3
        pred = sum(s["predicted_ms"] for s in rows) / 1e3
        errs = [100.0 * (s["predicted_ms"] - s["period_ms"]) / s["period_ms"] for s in rows if s["period_ms"] > 0]
        out[kind] = {"steps": len(rows), "measured_s": round(real, 4), "predicted_s": round(pred, 4),
                     "err_pct": _pct(pred, real),
                     "median_step_err_pct": round(statistics.median(errs), 2) if errs else None,
                     "mean_tokens": round(statistics.fmean(s["tokens"] for s in rows), 1),
                     "mean_reqs": round(statistics.fmean(s["reqs"] for s in rows), 1)}
    return out


def timeline(steps: list, add_s: float = 0.0) -> dict:
    """Cumulative predicted time against the measured results time at the last step with prefill
    rows (the end of the TTFT phase) and at the last step; ``add_s`` (adding the requests, before
    the step loop) is in the measured times and not in the simulator's."""
    done = [s for s in steps if s.get("done_s") is not None]
    if not done:
        return {}
    cum, marks = 0.0, {}
    last_prefill = max((i for i, s in enumerate(done) if s["kind"] != "decode"), default=None)
    for i, s in enumerate(done):
        cum += s["predicted_ms"] / 1e3
        if i in (last_prefill, len(done) - 1):
            real = s["done_s"] - add_s
            marks["end_of_prefill" if i == last_prefill else "end"] = {
                "step": i, "measured_s": round(real, 4), "predicted_s": round(cum, 4), "err_pct": _pct(cum, real)}
    return marks


def slowest(steps: list, n: int = 8) -> list:
    """The steps the cost model misses most, in ms either way."""
    rows = [s for s in steps if s.get("period_ms") is not None]
    rows.sort(key=lambda s: -abs(s["predicted_ms"] - s["period_ms"]))
    return [{k: s[k] for k in ("step", "kind", "reqs", "tokens", "prefill_tokens", "kv_read_tokens", "overlapped",
                               "launch_ms", "period_ms", "predicted_ms")} for s in rows[:n]]


def ttft_errors(real: Sequence[Optional[float]], sim: Sequence[Optional[float]]) -> dict:
    """TTFT percentiles (ms) of both, their errors, and the per-request error (same prompt order)."""
    pairs = [(r, s) for r, s in zip(real, sim) if r is not None and s is not None]
    if not pairs:
        return {}
    r = np.array([p[0] for p in pairs]) * 1e3
    s = np.array([p[1] for p in pairs]) * 1e3
    out = {"requests": len(pairs)}
    for q in PERCENTILES:
        a, b = float(np.percentile(r, q)), float(np.percentile(s, q))
        out[f"p{q}"] = {"measured_ms": round(a, 1), "sim_ms": round(b, 1), "err_pct": _pct(b, a)}
    d = s - r
    out["per_request_ms"] = {"mean": round(float(d.mean()), 1), "mean_abs": round(float(np.abs(d).mean()), 1),
                             "min": round(float(d.min()), 1), "max": round(float(d.max()), 1)}
    return out


def schedule_diff(real_steps: list, sim_steps: Sequence[tuple], real_prefix: str, sim_prefix: str) -> dict:
    """Whether the simulator scheduled the very steps the engine ran: rows (request, tokens, start
    position) step by step, request ids matched by their index in the trace."""
    def norm(rows, prefix):
        return tuple((rid[len(prefix):] if rid.startswith(prefix) else rid, n, start) for rid, n, start in rows)

    real = [norm(s["rows"], real_prefix) for s in real_steps]
    sim = [norm(rows, sim_prefix) for rows, _ in sim_steps]
    differ = [i for i, (a, b) in enumerate(zip(real, sim)) if a != b]
    return {"engine_steps": len(real), "sim_steps": len(sim), "differing_steps": len(differ) + abs(len(real) - len(sim)),
            "first_difference": differ[0] if differ else (min(len(real), len(sim)) if len(real) != len(sim) else None)}


def simulate_trace(trace: Path, profile: dict, model: str, async_scheduling: bool = True, engine_args=None):
    """The trace through the simulator in this process (``engine_args``; default: the engine
    arguments' defaults, as `tallyserve simulate` without flags), every step recorded; (SimResult,
    the Simulator)."""
    from tallyserve.bench.workloads import WorkloadOptions, build_workload
    from tallyserve.config import EngineArgs
    from tallyserve.sim.cli import engine_config_for, load_model_config
    from tallyserve.sim.profile_cost import ProfileCostModel
    from tallyserve.sim.simulator import SimOptions, Simulator

    mc = load_model_config(model)
    cost = ProfileCostModel(profile, mc)
    config = engine_config_for(engine_args or EngineArgs(), mc, cost.mem_bytes)
    workload = build_workload(WorkloadOptions(workload=f"file:{trace}", num_requests=1 << 62))
    sim = Simulator(config, cost, SimOptions(record_steps=True, async_scheduling=async_scheduling))
    return sim.run(workload), sim


def config_diff(a: dict, b: dict) -> dict:
    """Fields whose values differ between two configs (as dicts)."""
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def step_report(steps: list, cost, add_s: float = 0.0) -> dict:
    predict_steps(steps, cost)
    return {"by_kind": by_kind(steps), "timeline": timeline(steps, add_s), "worst_steps": slowest(steps)}


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="what benchmarks/serving.py fidelity wrote ($OUT)")
    ap.add_argument("--profile", default=None, help="a profile JSON (default: DIR/profile.json)")
    ap.add_argument("--model", default=None, help="model preset of the simulator (default: the profile's)")
    args = ap.parse_args(argv)
    from tallyserve.sim.cli import load_model_config
    from tallyserve.sim.profile_cost import ProfileCostModel

    d = Path(args.dir)
    profile = json.loads(Path(args.profile or d / "profile.json").read_text())
    model = args.model or profile.get("model") or "llama-3-8b"
    cost = ProfileCostModel(profile, load_model_config(model))
    runs = json.loads((d / "offline_steps.json").read_text())
    # the engine's mode: under async scheduling every step after the first launched with one in flight
    cost.async_scheduling = any(s["overlapped"] for run in runs.values() for s in run["steps"])
    report = {}
    for name, run in runs.items():
        report[name] = step_report(run["steps"], cost, run.get("add_s", 0.0))
        if "gc_pauses" in run:  # host stalls no cost model predicts (h200_runs freezes the heap since s12)
            report[name]["gc_pauses"] = run["gc_pauses"]
    trace = d / "mixed_trace.jsonl"
    ttft_path = d / "ttft.json"
    if trace.is_file() and "offline" in runs:
        res, _ = simulate_trace(trace, profile, model, cost.async_scheduling)
        report["schedule"] = schedule_diff(runs["offline"]["steps"], res.steps, "offline-", "mixed-")
        sim_ttft = [r.ttft_s for r in res.records]
        if ttft_path.is_file():
            measured = json.loads(ttft_path.read_text())
            report["ttft"] = {k: ttft_errors(v, sim_ttft) for k, v in measured.items() if k.startswith("offline")}
        report["sim_makespan_s"] = round(res.duration_s, 4)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
