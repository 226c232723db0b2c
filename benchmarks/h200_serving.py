#!/usr/bin/env python3
"""The serving path and the simulator against the offline engine, on one H200, in one call:

    python3 benchmarks/h200_serving.py [--model llama-3-8b] [--scale 1.0] [--profile-repeats 2]

1. offline   LLM(model, load_format="dummy"): warm-up, then h200_bench's mixed workload (256 requests,
             256-1024 prompt tokens, 256 new, greedy, ignore_eos); makespan and ledger. It runs twice
             (`--offline-runs`): first with the prompts' tokens shifted (same lengths, no prefix hits;
             `offline_first`: the process's first mixed run, which pays the first-run penalty of
             docs/benchmarks.md), then the trace itself (`offline`). Every step of both is recorded:
             its shape, host launch time and period (benchmarks/sim_fidelity.py).
2. profile   `tallyserve profile`'s grid measured on the same engine (batch 1-256, extra prefill tokens
             0-6800, context 0-1280): the step-time table `simulate --hardware` interpolates, the
             stream periods of async scheduling, and the prefill attention's time per query-key pair.
   steps     the cost model prices each recorded offline step (by kind: pure prefill, mixed, pure
             decode); the simulator replays the trace in this process and its schedule is compared
             with the engine's step by step; the engine's and the simulator's scheduler configs too.
3. http      the engine is freed; `tallyserve serve` with the same model and defaults starts in a
             subprocess; `tallyserve bench` sends the very same token-id prompts (a JSONL trace, all at
             t=0, streaming) after a short warm-up. Goal: makespan within 3% of offline. The server's
             /metrics give its ledger (scheduled == forward tokens).
4. simulate  `tallyserve simulate` replays the trace with the measured profile (and with the roofline
             model); makespan and TTFT p50/p99 against the HTTP run and against the offline runs (the
             engine alone, which is what the simulator models). Goal: within 5%. TTFT per request of
             every run in ttft.json.

Writes $OUT/h200_serving.json (summaries), offline_steps.json (every step of the offline runs, with
the cost model's prediction, and their step profiles), ttft.json, and the trace, profile and bench/sim
records, when $OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from h200_runs import mixed_prompts, run_requests  # noqa: E402
from h200_checks import log  # noqa: E402
from serving_overhead import _wait_healthy  # noqa: E402
import sim_fidelity  # noqa: E402


def _write_trace(path: Path, prompts, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"mixed-{i}", "prompt_token_ids": p, "max_tokens": max_tokens,
                                "arrival_s": 0.0}) + "\n")


def _metrics(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _pct_err(sim: float, real: float) -> float:
    return round(100.0 * (sim - real) / real, 2) if real else float("nan")


def run_http(args, out_dir: Path, trace: Path, warm: Path, name: str, env: dict, cli_main) -> dict:
    """Start `tallyserve serve` (same model and defaults, `env` added), warm it up, bench the trace."""
    url = f"http://127.0.0.1:{args.port}"
    log_file = open(out_dir / f"server_{name}.log", "w")
    path = os.pathsep.join(filter(None, [str(REPO), env.pop("PYTHONPATH_PREPEND", None), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "tallyserve.cli", "serve", "--model", args.model,
                             "--load-format", "dummy", "--dtype", args.dtype, "--port", str(args.port)],
                            stdout=log_file, stderr=subprocess.STDOUT, cwd=str(REPO),
                            env=dict(os.environ, PYTHONPATH=path, **env))
    try:
        try:
            _wait_healthy(url, proc, 600)
        except RuntimeError:
            log_file.flush()
            tail = (out_dir / f"server_{name}.log").read_text().splitlines()[-30:]
            raise RuntimeError("the server did not come up; the end of its log:\n" + "\n".join(tail)) from None
        cli_main(["bench", "--base-url", url, "--workload", f"file:{warm}", "--ignore-eos", "--disable-tqdm"])
        before = _metrics(url)
        record = out_dir / f"http_bench_{name}.json"
        rc = cli_main(["bench", "--base-url", url, "--workload", f"file:{trace}", "--ignore-eos", "--disable-tqdm",
                       "--output", str(record)])
        after = _metrics(url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
    http = json.loads(record.read_text())
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("tallyserve_scheduled_tokens_total",
                                                         "tallyserve_forward_tokens_total",
                                                         "tallyserve_ledger_violations_total")}
    return {"rc": rc, "duration_s": http["duration_s"], "completed": http["completed"], "errors": http["errors"],
            "input_tokens": http["total_input_tokens"], "output_tokens": http["total_output_tokens"],
            "ttft_p50_ms": http["p50_ttft_ms"], "ttft_p99_ms": http["p99_ttft_ms"],
            "itl_p50_ms": http["p50_itl_ms"], "itl_p99_ms": http["p99_itl_ms"], "ledger": d,
            "ledger_ok": d["tallyserve_scheduled_tokens_total"] == d["tallyserve_forward_tokens_total"]
            and d["tallyserve_ledger_violations_total"] == 0}


def _cost(engine, profile: dict):
    from tallyserve.sim.profile_cost import ProfileCostModel

    cost = ProfileCostModel(profile, engine.model_config)
    cost.async_scheduling = bool(engine.async_scheduling)
    return cost


def compare_steps(args, engine, profile: dict, trace: Path, step_runs: dict, ttft: dict, results: dict) -> dict:
    """The cost model on every recorded offline step, and the simulator's own run of the trace (in
    this process): its schedule against the engine's, its TTFT per request, its configs and modes.
    ``by_kind_before``: the same steps priced without the decode steps' graph padding and uneven lengths
    (the cost model of sim-fidelity2)."""
    import copy

    cost = _cost(engine, profile)
    out = {key: sim_fidelity.step_report(run["steps"], cost, run["add_s"]) for key, run in step_runs.items()}
    plain = {k: v for k, v in profile.items() if k not in ("decode_spread", "cuda_graph_batch_sizes")}
    for key, run in step_runs.items():
        out[key]["by_kind_before"] = sim_fidelity.step_report(copy.deepcopy(run["steps"]), _cost(engine, plain),
                                                              run["add_s"])["by_kind"]
    res, sim = sim_fidelity.simulate_trace(trace, profile, args.model, bool(engine.async_scheduling))
    ttft["sim_inprocess"] = [r.ttft_s for r in res.records]
    if "offline" in step_runs:
        out["schedule"] = sim_fidelity.schedule_diff(step_runs["offline"]["steps"], res.steps, "offline-", "mixed-")
    out["sim_inprocess_makespan_s"] = round(res.duration_s, 4)
    cfg = engine.config
    engine_sc = dict(cfg.scheduler_config.__dict__)
    out["sched_config_sim_vs_engine"] = sim_fidelity.config_diff(dict(sim.config.scheduler_config.__dict__), engine_sc)
    out["cache_config_sim_vs_engine"] = sim_fidelity.config_diff(dict(sim.config.cache_config.__dict__),
                                                                 dict(cfg.cache_config.__dict__))
    out["modes_sim_vs_engine"] = {
        "async_scheduling": [sim.async_scheduling, bool(engine.async_scheduling)],
        "cascade": [sim.cascade, bool(getattr(engine.runner, "use_cascade_attn", False))],
        "preemptions": [res.stats["preemptions"], results.get("offline", {}).get("stats", {}).get("preemptions")]}
    out["engine_scheduler_config"] = engine_sc  # compared with the CLI run's below, then dropped
    return out


def spread_report(profile: dict) -> dict:
    """The profile's uneven decode steps against the grid's even ones at the same mean context: the
    stream period and the total, ms more, and ms per token of the longest length past the mean."""
    sp = profile.get("decode_spread") or {}
    out = {}
    for i, b in enumerate(sp.get("batch_size", [])):
        gi = profile["batch_size"].index(b)
        for k, c in enumerate(sp["context_len"]):
            ck = profile["context_len"].index(c)
            mm = sp["max_minus_mean"][i][k]
            row = {"max_minus_mean": round(mm, 1)}
            for key in ("stream_time_s", "step_time_s"):
                even, uneven = profile[key][gi][0][ck], sp[key][i][k]
                row[key.split("_")[0] + "_ms"] = [round(even * 1e3, 3), round(uneven * 1e3, 3),
                                                  round((uneven - even) * 1e3, 3)]
            row["us_per_token"] = round((sp["stream_time_s"][i][k] - profile["stream_time_s"][gi][0][ck]) / mm * 1e6, 3)
            out[f"b{b}_c{c}"] = row
    return out


def replay_decode(engine, steps: list, repeats: int, picks: int = 3) -> list:
    """Recorded decode steps of the largest batch timed again as the profile times its steps (stream
    period, contiguous block tables): their own lengths in their own order, the same lengths longest
    first (the kernel's programs start in request order), and every request at the mean length. Next
    to the measured period (median of the step and its 10 neighbours) and the prediction."""
    from tallyserve.profile import rows_output, time_stream

    cc = engine.config.cache_config
    dec = [s for s in steps if s["kind"] == "decode"]
    if not dec:
        return []
    top = max(s["reqs"] for s in dec)
    full = [i for i, s in enumerate(steps) if s["kind"] == "decode" and s["reqs"] == top]
    out = []
    for j in sorted({full[int(q * (len(full) - 1))] for q in np.linspace(0.1, 0.9, picks)}):
        s = steps[j]
        ctx = [start for _, _, start in s["rows"]]
        mean = round(sum(ctx) / len(ctx))
        near = [t["period_ms"] for t in steps[max(0, j - 5): j + 6] if t["kind"] == "decode" and t["reqs"] == top]
        row = {"step": s["step"], "reqs": len(ctx), "mean": mean, "min": min(ctx), "max": max(ctx),
               "measured_ms": round(float(np.median(near)), 3), "predicted_ms": s.get("predicted_ms")}
        for name, lens in (("own_order", ctx), ("longest_first", sorted(ctx, reverse=True)),
                           ("shortest_first", sorted(ctx)), ("even", [mean] * len(ctx))):
            so = rows_output([(1, n) for n in lens], cc.block_size, cc.num_blocks)
            row[name + "_ms"] = round(time_stream(engine, so, repeats) * 1e3, 3)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--profile-repeats", type=int, default=2)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--offline-runs", type=int, default=2, choices=(1, 2),
                    help="2: a first mixed run (tokens shifted) before the trace's, which the simulator is compared with")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--http-variant", action="append", default=[],
                    help="NAME:ENV=VAL;ENV=VAL (PYTHONPATH_PREPEND=DIR adds a site dir): one server run each; "
                    "the first is compared with the simulator (default: one run, no extra env)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or "/tmp/h200_serving")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results: dict = {"model": args.model,
                     "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    from tallyserve import LLM
    from tallyserve.cli import main as cli_main
    from tallyserve.profile import run_profile

    # 1 + 2: offline makespan and the profile, on one engine
    llm = LLM(model=args.model, load_format="dummy", dtype=args.dtype)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompts, max_new = mixed_prompts(vocab, args.scale)
    trace = out_dir / "mixed_trace.jsonl"
    _write_trace(trace, prompts, max_new)
    rng = np.random.default_rng(3)
    far = time.perf_counter() + 3600
    max_len = engine.config.scheduler_config.max_model_len - 8
    for i, n in enumerate(min(n, max_len) for n in (2, 3, 6, 12, 24, 100, 700)):
        run_requests(engine, [rng.integers(0, vocab, size=n).tolist()] * 2, 4, far, f"warmup{i}")
    step_runs: dict = {}  # offline run -> its recorded steps (offline_steps.json)
    ttft: dict = {}  # run -> TTFT of each request, in prompt order (ttft.json)
    runs = [] if args.skip_offline else [("offline", prompts)]
    if runs and args.offline_runs == 2:  # same lengths, other tokens: no prefix hits on the trace's
        runs.insert(0, ("offline_first", [[(t + 17) % vocab for t in p] for p in prompts]))
    for key, run_prompts in runs:
        res = run_requests(engine, run_prompts, max_new, far, key, record_steps=True)
        step_runs[key] = {"add_s": res["add_s"], "step_profile": res.pop("step_profile"), "steps": res.pop("steps"),
                          "gc_pauses": res["gc_pauses"]}
        ttft[key] = res.pop("ttft_s")
        results[key] = res
        log(f"{key}: {res['wall_s']:.2f} s, TTFT p50 / p99 {res['latency_ms'].get('ttft_p50')} / "
            f"{res['latency_ms'].get('ttft_p99')} ms, ledger_ok {res['ledger_ok']}")
    t0 = time.perf_counter()
    grid = ([1, 16, 64, 128, 256], [0, 256, 1024, 2048, 4096, 6800], [0, 512, 1280]) if args.scale >= 1 else \
        ([1, 2, 4], [0, 8, 32], [0, 16, 48])  # a smoke run on a small model
    profile = run_profile(engine, *grid, args.profile_repeats, progress=False)
    (out_dir / "profile.json").write_text(json.dumps(profile, indent=1))
    results["profile_s"] = time.perf_counter() - t0
    log(f"profile: {results['profile_s']:.1f} s, prefill_pair_time_s {profile.get('prefill_pair_time_s')}")
    log(f"profile graphs {profile.get('cuda_graph_batch_sizes')}; decode spread (even, uneven, diff): "
        f"{json.dumps(spread_report(profile))}")
    results["decode_spread"] = spread_report(profile)
    if "offline" in step_runs:  # the recorded decode steps again, lengths as recorded, reordered, even
        sim_fidelity.predict_steps(step_runs["offline"]["steps"], _cost(engine, profile))
        results["decode_replay"] = replay_decode(engine, step_runs["offline"]["steps"], max(3, args.profile_repeats))
        log(f"decode replay: {json.dumps(results['decode_replay'])}")
    if step_runs and not args.skip_sim:
        results["steps"] = compare_steps(args, engine, profile, trace, step_runs, ttft, results)
        log(f"steps: {json.dumps(results['steps'])}")
    (out_dir / "offline_steps.json").write_text(json.dumps(step_runs))
    del engine, llm
    gc.collect()
    torch.cuda.empty_cache()

    # 3: the same trace over HTTP, once per server variant (the first is "http")
    warm = out_dir / "warm_trace.jsonl"
    _write_trace(warm, [rng.integers(0, vocab, size=min(n, max_len)).tolist() for n in (2, 24, 100, 700, 300, 50)], 4)
    for i, variant in enumerate([] if args.skip_http else args.http_variant or ["default"]):
        name, _, envs = variant.partition(":")
        env = dict(kv.split("=", 1) for kv in envs.split(";") if kv)
        key = "http" if i == 0 else f"http_{name}"
        results[key] = run_http(args, out_dir, trace, warm, name, env, cli_main)
        results[key]["env"] = env
        log(f"{key}: {json.dumps(results[key])}")
    if "offline" in results:
        for key in [k for k in results if k.startswith("http")]:
            results[key]["over_offline"] = round(results[key]["duration_s"] / results["offline"]["wall_s"], 4)

    # 4: the simulator replays the trace
    for tag, hw in [] if args.skip_sim else (("sim_profile", str(out_dir / "profile.json")), ("sim_roofline", "h200")):
        path = out_dir / f"{tag}.json"
        cli_main(["simulate", "--workload", f"file:{trace}", "--model-config", args.model, "--hardware", hw,
                  "--output", str(path), "--disable-tqdm"])
        sim = json.loads(path.read_text())
        results[tag] = {"makespan_s": sim["duration_s"], "ttft_p50_ms": sim["p50_ttft_ms"],
                        "ttft_p99_ms": sim["p99_ttft_ms"]}
        h = results.get("http")
        if h:
            results[tag].update(err_makespan_pct=_pct_err(sim["duration_s"], h["duration_s"]),
                                err_ttft_p50_pct=_pct_err(sim["p50_ttft_ms"], h["ttft_p50_ms"]),
                                err_ttft_p99_pct=_pct_err(sim["p99_ttft_ms"], h["ttft_p99_ms"]))
        ttft[tag] = [r.get("ttft_s") for r in sim["requests"]]
        for key in ("offline", "offline_first"):
            off = results.get(key)
            if off and off.get("latency_ms", {}).get("ttft_p50") is not None:
                # the engine the simulator models, without the HTTP path: the same trace run offline
                lat = off["latency_ms"]
                results[tag][f"vs_{key}"] = {"err_makespan_pct": _pct_err(sim["duration_s"], off["wall_s"]),
                                             "err_ttft_p50_pct": _pct_err(sim["p50_ttft_ms"], lat["ttft_p50"]),
                                             "err_ttft_p99_pct": _pct_err(sim["p99_ttft_ms"], lat["ttft_p99"]),
                                             "ttft": sim_fidelity.ttft_errors(ttft[key], ttft[tag])}
        if tag == "sim_profile" and "steps" in results:
            results["steps"]["sched_config_cli_vs_engine"] = sim_fidelity.config_diff(
                sim["config"]["scheduler"], results["steps"].pop("engine_scheduler_config"))
        log(f"{tag}: {json.dumps(results[tag])}")
    results.get("steps", {}).pop("engine_scheduler_config", None)
    (out_dir / "ttft.json").write_text(json.dumps(ttft))
    results["total_s"] = time.perf_counter() - t_start
    (out_dir / "h200_serving.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
