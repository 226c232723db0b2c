#!/usr/bin/env python3
"""The serving path and the simulator against the offline engine, and disaggregated prefill/decode.

    python benchmarks/serving.py overhead      # offline vs `tallyserve serve` (loop in a thread / own process)
    python benchmarks/serving.py fidelity      # one GPU: the mixed trace offline, over HTTP, in `tallyserve simulate`
    python benchmarks/serving.py reprice DIR   # fidelity's step records priced again by this checkout (no GPU)
    python benchmarks/serving.py disagg        # NIXL transfer bandwidth and the proxy path against colocated
    python benchmarks/serving.py itl-knobs     # simulator: inter-token latency against vLLM's partial-prefill knobs

`COMMAND --help` says what each measures and prints.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import torch

import _common
import sim_fidelity
from _common import REPO
from h200_runs import log, mixed_prompts, run_requests
from tallyserve.bench.metrics import summarize
from tallyserve.bench.workloads import RequestSpec, Workload
from tallyserve.config import EngineArgs
from tallyserve.sim.cli import engine_config_for, load_model_config
from tallyserve.sim.cost_model import load_cost_model
from tallyserve.sim.simulator import SimOptions, Simulator

OVERHEAD_DOC = """What the HTTP serving path costs over the offline engine, with the step loop in a thread of the
server and in the engine core process (--enable-frontend-multiprocessing):

    python benchmarks/serving.py overhead                # a tiny random model on the CPU
    python benchmarks/serving.py overhead --model llama-3-8b --load-format dummy \\
        --tokenizer <dir> --device cuda                          # the H200 case

The same N requests of random token-id prompts (--input-len tokens, --output-len new tokens, greedy,
ignore_eos), all sent at once:
1. offline  `LLM.generate` (in a subprocess, so its memory is gone before the servers start),
2. thread   `tallyserve serve` (step loop in a thread) + `tallyserve bench` (streaming),
3. process  `tallyserve serve --enable-frontend-multiprocessing` + `tallyserve bench`.
Each after a short warm-up. Prints the three makespans and their ratios to offline; writes JSON to
--output (default $OUT/serving_overhead.json, or /tmp/serving_overhead/serving_overhead.json).
Without --model, a random Llama (2 layers, hidden 64, vocab 256, ChatML-free tokenizer) is written
under the output directory, so the run is host-bound like the H200 case."""

FIDELITY_DOC = """The serving path and the simulator against the offline engine, on one H200, in one call:

    python benchmarks/serving.py fidelity [--model llama-3-8b] [--scale 1.0] [--profile-repeats 2]

1. offline   LLM(model, load_format="dummy"): warm-up, then gpu.py's mixed workload (256 requests,
             256-1024 prompt tokens, 256 new, greedy, ignore_eos); makespan and ledger. It runs twice
             (`--offline-runs`): first with the prompts' tokens shifted (same lengths, no prefix hits;
             `offline_first`: the process's first mixed run, which pays the first-run penalty of
             docs/benchmarks.md), then the trace itself (`offline`). Every step of both is recorded:
             its shape, host launch time and period (sim_fidelity.py).
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

Writes $OUT/serving_fidelity.json (summaries), offline_steps.json (every step of the offline runs, with
the cost model's prediction, and their step profiles), ttft.json, and the trace, profile and bench/sim
records, when $OUT is set."""

DISAGG_DOC = """Disaggregated prefill/decode figures.

1. ``transfer``: KV transfer bandwidth of the NixlConnector's own path. Two processes each build a
   NixlConnectorWorker over KV caches of a model's shape; the consumer READs N blocks from the
   producer as a real load and reports GB/s per size, for blocks consecutive on both sides (one
   descriptor per layer and K/V half) and scattered ones (one per layer, K/V half and block).
2. ``proxy``: per-request overhead of the proxy path. A kv_producer, a kv_consumer and `tallyserve
   proxy`, plus one colocated instance, as separate processes; the same greedy requests go to the
   colocated instance and through the proxy, one at a time; the report gives latency p50/p99 of
   each and the difference.

CPU (the bundled model):       python benchmarks/serving.py disagg
One H200, two processes sharing the card:
    python benchmarks/serving.py disagg --device cuda --model llama-3-8b --load-format dummy \\
        --gpu-memory-utilization 0.45 --prompt-len 1024 --max-tokens 128 --requests 64 --request-rate 4
(the colocated instance then runs after the pair, with the same memory share, not beside it;
--request-rate adds TTFT / ITL p50/p99 at a fixed Poisson rate through `tallyserve bench`)."""

ITL_DOC = """Inter-token latency vs vLLM's partial prefill knobs, in the simulator (virtual time, no GPU).

    python benchmarks/serving.py itl-knobs [--model-config llama-3-8b] [--hardware h200]
                                        [--num-requests 256] [--output-len 256] [--json PATH]

The workload is gpu.py's "mixed" one: 256 requests arriving at once, prompts uniform in
[256, 1024] tokens (random ids, numpy seed 0), 256 new tokens each (ignore_eos). Each setting runs the
real Scheduler + KV cache manager on the roofline cost model of the model's shape on one H200 (async
scheduling on, as on a GPU), and the ledger is checked every step. Settings: the defaults, then
long_prefill_token_threshold 512 / 1024 / 2048 with max_num_partial_prefills 2 / 4 (vLLM's default
max_long_partial_prefills=1, then max_long_partial_prefills = max_num_partial_prefills), and for
reference a smaller max_num_batched_tokens. Prints one table: output throughput, TTFT p50 / p99,
ITL p99 (the gap between a request's consecutive tokens), and the largest step (tokens)."""



# ============================================================================= overhead
OVERHEAD_MODES = ("offline", "thread", "process")


def _overhead_engine_flags(args) -> list[str]:
    flags = ["--model", args.model, "--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
             "--max-num-seqs", str(max(args.num_requests, 1))]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    return flags + list(args.engine_arg)


def _overhead_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _overhead_trace(path: Path, prompts: list[list[int]], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"r-{i}", "prompt_token_ids": p, "max_tokens": max_tokens,
                                "arrival_s": 0.0}) + "\n")


def _overhead_vocab(args) -> int:
    from tallyserve.models.loader import resolve_model

    return resolve_model(args.model, args.load_format).model_config.vocab_size


def overhead_offline_worker(args) -> int:
    """Subprocess: warm up, then generate every prompt at once; print the makespan as JSON."""
    from tallyserve import LLM, SamplingParams
    from tallyserve.cli import build_parser

    ns = build_parser().parse_args(["serve", *_overhead_engine_flags(args)])
    from tallyserve.config.args import engine_args_from

    llm = LLM(**{k: v for k, v in vars(engine_args_from(ns)).items()})
    trace = [json.loads(line) for line in Path(args.trace).read_text().splitlines()]
    warm = [json.loads(line) for line in Path(args.warm_trace).read_text().splitlines()]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": t["prompt_token_ids"]} for t in warm],
                 SamplingParams(max_tokens=warm[0]["max_tokens"], **greedy), use_tqdm=False)
    prompts = [{"prompt_token_ids": t["prompt_token_ids"]} for t in trace]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=trace[0]["max_tokens"], **greedy), use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"duration_s": wall, "completed": len(outs), "output_tokens": tokens}), flush=True)
    return 0


def overhead_offline(args, out_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "overhead", "--offline-worker", "--trace", str(out_dir / "trace.jsonl"),
           "--warm-trace", str(out_dir / "warm.jsonl"), *_overhead_script_flags(args)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"offline run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def overhead_server(args, out_dir: Path, mode: str) -> dict:
    from tallyserve.cli import main as cli_main

    port = _common.free_port()
    url = f"http://127.0.0.1:{port}"
    flag = "--enable-frontend-multiprocessing" if mode == "process" else "--disable-frontend-multiprocessing"
    log = open(out_dir / f"server_{mode}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tallyserve.cli", "serve", *_overhead_engine_flags(args),
                             "--port", str(port), "--log-level", "warning", "--disable-access-log", flag],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    record = out_dir / f"bench_{mode}.json"
    try:
        _common.wait_healthy(url, proc, 900)
        cli_main(["bench", "--base-url", url, "--workload", f"file:{out_dir / 'warm.jsonl'}", "--ignore-eos",
                  "--disable-tqdm"])
        rc = cli_main(["bench", "--base-url", url, "--workload", f"file:{out_dir / 'trace.jsonl'}", "--ignore-eos",
                       "--disable-tqdm", "--output", str(record)])
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    bench = json.loads(record.read_text())
    return {"rc": rc, "duration_s": bench["duration_s"], "completed": bench["completed"], "errors": bench["errors"],
            "output_tokens": bench["total_output_tokens"], "ttft_p50_ms": bench.get("p50_ttft_ms"),
            "itl_p50_ms": bench.get("p50_itl_ms"), "itl_p99_ms": bench.get("p99_itl_ms")}


def _overhead_script_flags(args) -> list[str]:
    out = ["--model", args.model, "--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
           "--num-requests", str(args.num_requests)]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    for e in args.engine_arg:
        out.append(f"--engine-arg={e}")
    return out


def _overhead_tiny_model(out_dir: Path) -> str:
    from tallyserve.bench.tiny_models import make_tiny_model, make_tiny_tokenizer

    path = out_dir / "tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_model(path, "llama", seed=0, num_hidden_layers=2, hidden_size=64)
        make_tiny_tokenizer(str(path))
    return str(path)


def cmd_overhead(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, OVERHEAD_DOC)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama written to the output directory")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--modes", default=",".join(OVERHEAD_MODES), help="comma-separated subset of offline,thread,process")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="an extra engine flag for all three runs, e.g. --engine-arg=--block-size=16")
    ap.add_argument("--output", default=None)
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-trace", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.offline_worker:
        return overhead_offline_worker(args)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(OVERHEAD_MODES):
        ap.error(f"--modes must be a subset of {','.join(OVERHEAD_MODES)}")
    output = Path(args.output) if args.output else Path(os.environ.get("OUT") or "/tmp/serving_overhead") / \
        "serving_overhead.json"
    out_dir = output.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = _overhead_tiny_model(out_dir)
    vocab = _overhead_vocab(args)
    _overhead_trace(out_dir / "trace.jsonl", _overhead_prompts(vocab, args.num_requests, args.input_len, 0),
                    args.output_len)
    _overhead_trace(out_dir / "warm.jsonl", _overhead_prompts(vocab, 8, args.input_len, 1), 8)
    results: dict = {"model": args.model, "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "engine_args": args.engine_arg, "cpu_count": os.cpu_count()}
    for mode in modes:
        results[mode] = overhead_offline(args, out_dir) if mode == "offline" else overhead_server(args, out_dir, mode)
        print(f"{mode:8s} makespan {results[mode]['duration_s']:.3f} s", flush=True)
    if "offline" in results:
        base = results["offline"]["duration_s"]
        for mode in ("thread", "process"):
            if mode in results:
                results[mode]["over_offline"] = round(results[mode]["duration_s"] / base, 4)
                print(f"{mode:8s} / offline = {results[mode]['over_offline']:.3f}", flush=True)
    if "thread" in results and "process" in results:
        results["process_over_thread"] = round(results["process"]["duration_s"] / results["thread"]["duration_s"], 4)
        print(f"process / thread = {results['process_over_thread']:.3f}", flush=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"wrote {output}", flush=True)
    return 0


# ============================================================================= fidelity
def _mixed_trace(path: Path, prompts, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"mixed-{i}", "prompt_token_ids": p, "max_tokens": max_tokens,
                                "arrival_s": 0.0}) + "\n")


def _server_metrics(url: str) -> dict:
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
            _common.wait_healthy(url, proc, 600)
        except RuntimeError:
            log_file.flush()
            tail = (out_dir / f"server_{name}.log").read_text().splitlines()[-30:]
            raise RuntimeError("the server did not come up; the end of its log:\n" + "\n".join(tail)) from None
        cli_main(["bench", "--base-url", url, "--workload", f"file:{warm}", "--ignore-eos", "--disable-tqdm"])
        before = _server_metrics(url)
        record = out_dir / f"http_bench_{name}.json"
        rc = cli_main(["bench", "--base-url", url, "--workload", f"file:{trace}", "--ignore-eos", "--disable-tqdm",
                       "--output", str(record)])
        after = _server_metrics(url)
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


def cmd_fidelity(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, FIDELITY_DOC)
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
    args = ap.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or "/tmp/serving_fidelity")
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
    _mixed_trace(trace, prompts, max_new)
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
    _mixed_trace(warm, [rng.integers(0, vocab, size=min(n, max_len)).tolist() for n in (2, 24, 100, 700, 300, 50)], 4)
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
    (out_dir / "serving_fidelity.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2), flush=True)
    return 0


# ============================================================================= reprice


def cmd_reprice(argv: list[str], prog: str) -> int:
    return sim_fidelity.main(argv, prog)


# ============================================================================= disagg
# ----------------------------------------------------------------------------- transfer
def _transfer_worker(role: str, conn, shape, dtype_name: str, device: str, engine_id: str) -> None:
    import torch

    from tallyserve.core.sched_output import RemoteKVLoad
    from tallyserve.distributed.kv_transfer.base import KVConnectorMetadata
    from tallyserve.config.kv_transfer import KVTransferConfig
    from tallyserve.distributed.kv_transfer.nixl_connector import NixlConnectorWorker

    layers, blocks, block_size, heads, head_dim = shape
    dtype = getattr(torch, dtype_name)
    caches = [torch.full((2, blocks, block_size, heads, head_dim), float(i + 1 if role == "p" else 0), dtype=dtype,
                         device=device) for i in range(layers)]
    cfg = KVTransferConfig(kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=engine_id)
    w = NixlConnectorWorker(cfg, block_size)
    w.register_kv_caches(caches)
    conn.send(w.metadata())
    if role == "p":
        conn.recv()  # until the consumer is done
        return
    w.add_remote(conn.recv())
    results = []
    import random

    for n, pattern in [(n, p) for n in conn.recv() for p in ("contiguous", "scattered")]:
        ids = tuple(range(n))
        # scattered: the producer's blocks in a random order, so no two neighbours stay neighbours (one
        # descriptor per block and layer half); contiguous: one descriptor per layer half
        far = ids if pattern == "contiguous" else tuple(random.Random(n).sample(ids, n))
        best = float("inf")
        for rep in range(3):
            load = RemoteKVLoad(f"r{n}-{pattern}-{rep}", ids, far, 0, n * block_size,
                                {"remote_engine_id": "bench-p", "remote_request_id": f"r{n}-{pattern}-{rep}",
                                 "remote_host": "127.0.0.1", "remote_port": 1})
            t0 = time.perf_counter()
            w.start_load_kv(KVConnectorMetadata(loads=(load,)))
            while True:
                out = w.get_finished()
                if out.finished_recving or out.failed_recving:
                    break
            best = min(best, time.perf_counter() - t0)
            assert not out.failed_recving, out.failed_recving
        nbytes = 2 * layers * n * caches[0][0, 0].numel() * caches[0].element_size()
        ok = bool((caches[-1][:, :n] == layers).all())
        results.append({"blocks": n, "pattern": pattern, "bytes": nbytes, "seconds": best, "GB_per_s": nbytes / best / 1e9, "ok": ok})
    conn.send(results)


def bench_transfer(ns) -> list[dict]:
    from tallyserve.models.loader import resolve_model

    mc = resolve_model(ns.model, ns.load_format).model_config
    shape = (mc.num_hidden_layers, max(ns.transfer_blocks), ns.block_size, mc.num_key_value_heads, mc.head_dim)
    ctx = mp.get_context("spawn")
    pa, pb = ctx.Pipe()
    ca, cb = ctx.Pipe()
    procs = [ctx.Process(target=_transfer_worker, args=("p", pb, shape, ns.kv_dtype, ns.device, "bench-p")),
             ctx.Process(target=_transfer_worker, args=("c", cb, shape, ns.kv_dtype, ns.device, "bench-c"))]
    for p in procs:
        p.start()

    def recv(conn, timeout: float = 300.0):
        """The next message, or RuntimeError once a worker died or the timeout passed (never a hang)."""
        deadline = time.monotonic() + timeout
        while not conn.poll(0.5):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a transfer worker failed (exit codes {[p.exitcode for p in procs]})")
        return conn.recv()

    prod_meta, _ = recv(pa), recv(ca)
    ca.send(prod_meta)
    ca.send(list(ns.transfer_blocks))
    results = recv(ca)
    pa.send("done")
    for p in procs:
        p.join(30)
    return results


# ----------------------------------------------------------------------------- proxy
def _disagg_start(cmd: list[str], url: str, log) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def _serve_cmd(ns, port: int, kv: dict | None) -> list[str]:
    exe = [sys.executable, "-m", "tallyserve.cli"]
    cmd = exe + ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--disable-access-log",
                 "--device", ns.device, "--block-size", str(ns.block_size)]
    if ns.model:
        cmd += ["--model", ns.model, "--load-format", ns.load_format]
    if ns.device.startswith("cuda"):
        cmd += ["--gpu-memory-utilization", str(ns.gpu_memory_utilization)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def _disagg_latencies(url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    out = []
    with httpx.Client(timeout=600) as c:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]
        for p in prompts:
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def _disagg_pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rate_bench(url: str, trace: str, rate: float, out: str) -> dict:
    """`tallyserve bench` over a token-id trace at a Poisson request rate (streaming): TTFT / ITL."""
    from tallyserve.cli import main as cli_main

    cli_main(["bench", "--base-url", url, "--workload", f"file:{trace}", "--request-rate", str(rate),
              "--ignore-eos", "--disable-tqdm", "--output", out])
    r = json.loads(open(out).read())
    return {k: r[k] for k in ("completed", "errors", "duration_s", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
                              "p99_itl_ms", "output_throughput")}


def _disagg_trace(path: str, prompts: list[list[int]], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"r{i}", "prompt_token_ids": p, "max_tokens": max_tokens}) + "\n")


def bench_proxy(ns) -> dict:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 20000) for _ in range(ns.prompt_len)] for _ in range(ns.requests)]
    ports = [_common.free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = open(os.path.join(ns.out_dir, "disagg_servers.log"), "w")  # the servers' output, for a failed start
    procs = []
    try:
        procs.append(_disagg_start(_serve_cmd(ns, ports[0], {"kv_role": "kv_producer", "engine_id": "bench-prefill"}),
                            urls[0], logs))
        procs.append(_disagg_start(_serve_cmd(ns, ports[1], {"kv_role": "kv_consumer", "engine_id": "bench-decode"}),
                            urls[1], logs))
        procs.append(_disagg_start([sys.executable, "-m", "tallyserve.cli", "proxy", "--port", str(ports[2]),
                             "--prefill", urls[0], "--decode", urls[1]], urls[2], logs))
        _disagg_latencies(urls[2], prompts[:2], ns.max_tokens)  # warm up (first handshake included here)
        disagg = _disagg_latencies(urls[2], [p[::-1] for p in prompts], ns.max_tokens)
        rated = {}
        if ns.request_rate:
            trace = os.path.join(ns.out_dir, "rate_trace.jsonl")
            _disagg_trace(trace, [[(t * 7 + 3) % 20000 + 10 for t in p] for p in prompts], ns.max_tokens)
            rated["disagg"] = _rate_bench(urls[2], trace, ns.request_rate, os.path.join(ns.out_dir, "rate_disagg.json"))
        lines = httpx.get(urls[1] + "/metrics").text.splitlines()
        stats = dict(line.split(" ", 1) for line in lines if line.startswith("tallyserve_kv_connector_"))
        for p in procs:
            p.terminate()
            p.wait(30)
        procs = [_disagg_start(_serve_cmd(ns, ports[3], None), urls[3], logs)]
        _disagg_latencies(urls[3], prompts[:2], ns.max_tokens)
        colocated = _disagg_latencies(urls[3], [p[::-1] for p in prompts], ns.max_tokens)
        if ns.request_rate:
            rated["colocated"] = _rate_bench(urls[3], trace, ns.request_rate,
                                             os.path.join(ns.out_dir, "rate_colocated.json"))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    return {"requests": ns.requests, "prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens,
            "colocated_p50_s": _disagg_pct(colocated, 0.5), "colocated_p99_s": _disagg_pct(colocated, 0.99),
            "disagg_p50_s": _disagg_pct(disagg, 0.5), "disagg_p99_s": _disagg_pct(disagg, 0.99),
            "overhead_p50_ms": 1000 * (_disagg_pct(disagg, 0.5) - _disagg_pct(colocated, 0.5)),
            "overhead_mean_ms": 1000 * (statistics.mean(disagg) - statistics.mean(colocated)),
            "decode_kv_counters": stats, "request_rate": ns.request_rate, "at_rate": rated}


def cmd_disagg(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, DISAGG_DOC)
    ap.add_argument("--only", choices=["transfer", "proxy"], default=None)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="float32", help="KV dtype of the transfer test (bfloat16 on GPUs)")
    ap.add_argument("--transfer-blocks", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="proxy: also send the requests (other tokens) at this Poisson rate through `tallyserve bench`, "
                    "through the proxy and to the colocated instance: TTFT and ITL p50/p99")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "/tmp", help="where the rate traces and records go")
    ns = ap.parse_args(argv)
    # the servers and transfer workers this starts import tallyserve from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    report = {}
    if ns.only in (None, "transfer"):
        report["transfer"] = bench_transfer(ns)
        for r in report["transfer"]:
            print(f"transfer {r['blocks']:4d} blocks {r['pattern']:10s} {r['bytes'] / 1e6:8.2f} MB  {r['seconds'] * 1e3:8.2f} ms  "
                  f"{r['GB_per_s']:6.2f} GB/s  {'ok' if r['ok'] else 'WRONG BYTES'}")
    if ns.only in (None, "proxy"):
        report["proxy"] = bench_proxy(ns)
        print(json.dumps(report["proxy"], indent=1))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=1)


# ============================================================================= itl-knobs
def _itl_workload(vocab: int, num_requests: int, output_len: int) -> Workload:
    """gpu.py's mixed prompts: lengths uniform in [256, 1024], random ids, seed 0."""
    rng = np.random.default_rng(0)
    lens = rng.integers(256, 1024 + 1, size=num_requests)
    specs = [RequestSpec(f"mixed-{i}", output_len, prompt_token_ids=rng.integers(0, vocab, size=int(n)).tolist(),
                         arrival_s=0.0) for i, n in enumerate(lens)]
    return Workload("mixed", specs)


def _itl_settings() -> list[tuple[str, dict]]:
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


def _itl_run_one(model_config: str, hardware: str, workload_args: tuple, overrides: dict) -> dict:
    mc = load_model_config(model_config)
    cost = load_cost_model(hardware, mc)
    config = engine_config_for(EngineArgs(**overrides), mc, cost.mem_bytes)
    workload = _itl_workload(mc.vocab_size, *workload_args)
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


def cmd_itl_knobs(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, ITL_DOC)
    ap.add_argument("--model-config", default="llama-3-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ns = ap.parse_args(argv)

    rows = []
    t0 = time.perf_counter()
    for label, overrides in _itl_settings():
        row = _itl_run_one(ns.model_config, ns.hardware, (ns.num_requests, ns.output_len), overrides)
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


COMMANDS: dict[str, _common.Command] = {
    "overhead": ("the HTTP path's cost over the offline engine: step loop in a thread vs the engine core process",
                 cmd_overhead),
    "fidelity": ("one GPU: the mixed trace offline, over HTTP and in the simulator with a profile measured in the call",
                 cmd_fidelity),
    "reprice": ("fidelity's saved step records priced again by this checkout's cost model (no GPU)", cmd_reprice),
    "disagg": ("disaggregated prefill/decode: NIXL transfer bandwidth, the proxy path against colocated", cmd_disagg),
    "itl-knobs": ("simulator: ITL p99 and throughput under vLLM's partial-prefill knobs (no GPU)", cmd_itl_knobs),
}


if __name__ == "__main__":
    sys.exit(_common.run_tool(__doc__, COMMANDS))
