#!/usr/bin/env python3
"""tallyserve on one H200, in one call (<= 9 minutes by default): run from the repo root as

    python3 benchmarks/h200_bench.py [--only micro,checks,mixed,shared,decode] [--with-hf]
                                     [--enforce-eager] [--graph-ab] [--async-ab] [--pytest]

Sections (in this order; each is skipped once --budget-s, default 540 s, is spent; --pytest and
--with-hf run before the engine is built, since the engine takes most of the card for its KV pool):
  micro   bf16 matmul TFLOP/s (8192^3, median of 10) and device copy bandwidth
  checks  quick GPU checks: Triton kernels vs the torch reference at Llama-3-8B attention shapes
          (mixed batch, split-K decode), and CUDA-graph replay vs eager on the real model
  tune    (only when named) sweep of kernel tile/warp/stage options, for KernelConfig defaults
  mixed   256 requests, prompts uniform in [256, 1024] tokens (random ids, seed 0), 256 new tokens
  shared  128 requests: one 2048-token prefix + 64 unique tokens, 64 new tokens each
  decode  one request (512-token prompt): median step time over 128 decode steps, the engine's
          per-step time split, and the GPU time of one graph replay at batch 1
          (--graph-ab: again with the CUDA-graph runner switched off, same engine)
          (--async-ab: mixed, shared and decode again with async scheduling off, same engine)
  --with-hf: afterwards, Hugging Face `generate_batch` on the same mixed/shared prompts (~4 min)
  --pytest:  also `python -m pytest -q tests/gpu` in a subprocess (needs pytest; ~1 min)
mixed/shared also report a step profile: steps with prefill rows vs decode-only steps (graph or
eager), their total and median time, and the slowest steps (a compile stall shows up there).

Model: LLM(model="llama-3-8b", load_format="dummy", dtype="bfloat16"): random weights at the real
shape, greedy, ignore_eos. Needs only torch, triton, transformers (for --with-hf), numpy. Prints a
short table last; writes everything as JSON to $OUT/h200_bench.json when $OUT is set. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROOFLINE = {"mixed_s": 6.2, "decode_step_ms": 3.8}
SECTIONS = ("micro", "checks", "mixed", "shared", "decode", "tune", "cascade")  # the last two: not by default


from h200_checks import bench_micro, log, run_cascade_tune, run_graph_check, run_kernel_checks, run_tune  # noqa: E402
from h200_runs import (  # noqa: E402
    HF_SECONDS, ITL_CONFIGS, _record_triton_compiles, mixed_prompts, run_decode, run_hf, run_itl_sweep, run_requests,
    shared_prompts,
)


def _table(results: dict) -> str:
    rows = [("section", "result")]
    m = results.get("micro")
    if m and "matmul_bf16_tflops" in m:
        rows.append(("micro", f"matmul {m['matmul_bf16_tflops']:.0f} TFLOP/s; copy {m['copy_read_plus_write_tb_s']:.2f} TB/s"
                              f" (read+write), {m['copy_one_way_tb_s']:.2f} TB/s one-way"))
    if results.get("checks"):
        bad = [c["name"] for c in results["checks"] if not c.get("ok")]
        rows.append(("checks", "all ok" if not bad else f"FAILED: {bad}"))
    hf = results.get("hf", {})
    for name in ("mixed", "shared", "mixed_sync", "shared_sync", "mixed_nocascade", "shared_nocascade"):
        r = results.get(name)
        if not r or "wall_s" not in r:
            continue
        base = name.split("_")[0]
        line = (f"{r['wall_s']:.2f} s, {r['total_tok_s']:.0f} tok/s ({r['output_tok_s']:.0f} out tok/s), "
                f"x{HF_SECONDS[base] / r['wall_s']:.1f} vs HF {HF_SECONDS[base]} s")
        if base == "mixed":
            line += f", {r['wall_s'] / ROOFLINE['mixed_s']:.1f}x roofline {ROOFLINE['mixed_s']} s"
        if isinstance(hf.get(base), dict) and "wall_s" in hf[base]:
            line += f", HF here {hf[base]['wall_s']:.1f} s (x{hf[base]['wall_s'] / r['wall_s']:.1f})"
            if hf[base].get("error"):
                line += f" HF ERROR: {hf[base]['error']}"
        t = r["timings_s"]
        parts = "/".join(f"{t.get(k, 0):.1f}" for k in ("schedule", "launch", "wait", "update"))
        line += (f"; ledger {'ok' if r['ledger_ok'] else 'VIOLATED'}; graphs {r['graph_replays']} (cascade {r.get('cascade_replays', 0)})"
                 f"; steps {r['stats'].get('steps')} (async {r['stats'].get('async_steps')}); t[s/b/f/s/w/u]={parts}")
        for kind, g in r.get("step_profile", {}).items():
            if kind != "slowest":
                line += (f"; {kind}: {g['steps']} steps {g['total_s']:.1f} s"
                         f" (median {g['median_ms']:.1f} ms, {g['mean_reqs']:.0f} reqs)")
        lat = r.get("latency_ms") or {}
        if "itl_p99" in lat:
            line += f"; TTFT p50/p99 {lat['ttft_p50']:.0f}/{lat['ttft_p99']:.0f} ms, ITL p50/p99 {lat['itl_p50']:.1f}/{lat['itl_p99']:.1f} ms"
        if r.get("triton_compiles"):
            line += f"; {len(r['triton_compiles'])} Triton compiles inside the run"
        if r.get("timed_out"):
            line += " (TIMED OUT: partial)"
        rows.append((name, line))
    for row in results.get("itl_sweep", []):
        if "wall_s" in row:
            rows.append((f"itl {row['config'] or 'default'}",
                         f"{row['wall_s']:.2f} s, {row['total_tok_s']} tok/s; ITL p50/p99 {row.get('itl_p50')}/{row.get('itl_p99')} ms"
                         f" (max {row.get('itl_max')}); TTFT p50/p99 {row['ttft_p50']}/{row['ttft_p99']} ms"))
    d = results.get("decode")
    if d:
        for key, r in d.items():
            if r.get("median_step_ms"):
                rows.append((f"decode[{key}]", f"median {r['median_step_ms']:.2f} ms/step (p90 {r['p90_step_ms']:.2f},"
                                              f" mean {r['mean_step_ms']:.2f}),"
                                              f" {r['median_step_ms'] / ROOFLINE['decode_step_ms']:.2f}x floor 3.8 ms,"
                                              f" {r['decode_steps']} steps"
                                              + (f"; GPU replay b=1 {r['gpu_graph_replay_b1_ms']:.2f} ms"
                                                 + (" (with lm_head)" if r.get("graph_b1_includes_lm_head") else "")
                                                 if r.get("gpu_graph_replay_b1_ms") else "")
                                              + "; per step ms " + "/".join(f"{v:.1f}" for v in
                                                                           r["timings_ms_per_step"].values())))
    if results.get("pytest"):
        rows.append(("pytest", results["pytest"].get("summary", "?")))
    for k in results.get("skipped", []):
        rows.append(("skipped", k))
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS[:-2]), help=f"comma list of {SECTIONS}")
    ap.add_argument("--with-hf", action="store_true", help="also run HF generate_batch on mixed/shared (slow)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (A/B against the default)")
    ap.add_argument("--graph-ab", action="store_true", help="decode: also time with the graph runner switched off")
    ap.add_argument("--async-ab", action="store_true", help="also run each workload with async scheduling off")
    ap.add_argument("--itl-sweep", action="store_true",
                    help="run the mixed workload again under smaller step budgets and the partial prefill knobs: "
                         "throughput against inter-token latency")
    ap.add_argument("--cascade-ab", action="store_true",
                    help="also run each workload with cascade attention off (disable_cascade_attn)")
    ap.add_argument("--decode-sampling", action="store_true",
                    help="decode: also time temperature 0.8, top_p 0.95, top_k 50 sampling")
    ap.add_argument("--pytest", action="store_true", help="also run pytest tests/gpu in a subprocess")
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip sections once this much time has passed")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (smoke tests)")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--engine-arg", action="append", default=[], help="extra LLM kwarg, key=value (bool/int/float/str)")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    results: dict = {"args": vars(args), "skipped": [], "env": {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}}
    try:
        import triton
        results["env"]["triton"] = triton.__version__
    except ImportError:
        results["env"]["triton"] = None
    log(f"env {results['env']}")
    on_gpu = torch.cuda.is_available()

    if "micro" in only and on_gpu:
        results["micro"] = bench_micro()
        log(f"micro {results['micro']}")
    if "checks" in only and on_gpu:
        results["checks"] = run_kernel_checks()
    if "tune" in only and on_gpu:
        results["tune"] = run_tune()
    if "cascade" in only and on_gpu:
        results["cascade"] = run_cascade_tune()

    if args.pytest:
        try:
            import pytest  # noqa: F401
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "tests/gpu"], cwd=REPO,
                                  capture_output=True, text=True, timeout=max(60, deadline - time.perf_counter()))
            tail = proc.stdout.strip().splitlines()
            results["pytest"] = {"rc": proc.returncode, "summary": tail[-1] if tail else "", "tail": proc.stdout[-3000:]}
        except ImportError:
            results["pytest"] = {"summary": "pytest not installed"}
        except subprocess.TimeoutExpired:
            results["pytest"] = {"summary": "timed out"}

    if args.with_hf and on_gpu:
        # Before our engine exists: it takes gpu_memory_utilization of the card for its KV pool.
        from tallyserve.models.loader import resolve_model

        hf_vocab = resolve_model(args.model, "dummy").model_config.vocab_size
        hf_loads = {"mixed": mixed_prompts(hf_vocab, args.scale), "shared": shared_prompts(hf_vocab, args.scale)}
        results["hf"] = run_hf(args.model, {k: v for k, v in hf_loads.items() if k in only}, deadline)

    engine = None
    if only & {"mixed", "shared", "decode"} or ("checks" in only and on_gpu):  # they need the engine
        from tallyserve import LLM

        kwargs = dict(load_format="dummy", dtype=args.dtype, enforce_eager=args.enforce_eager)
        for kv in args.engine_arg:
            key, val = kv.split("=", 1)
            if val.lower() in ("true", "false"):
                kwargs[key] = val.lower() == "true"
                continue
            for conv in (int, float):
                try:
                    val = conv(val)
                    break
                except ValueError:
                    pass
            kwargs[key] = val
        t0 = time.perf_counter()
        llm = LLM(model=args.model, **kwargs)
        engine = llm.engine
        results["engine_init_s"] = time.perf_counter() - t0
        results["engine"] = {"backend": engine.runner.model.attn_backend.name,
                             "num_blocks": engine.config.cache_config.num_blocks,
                             "max_model_len": engine.config.scheduler_config.max_model_len,
                             "max_num_batched_tokens": engine.config.scheduler_config.max_num_batched_tokens,
                             "cuda_graphs": getattr(engine.runner, "graph_runner", None) is not None}
        log(f"engine ready in {results['engine_init_s']:.1f} s: {results['engine']}")
        if "checks" in only and on_gpu:
            results["checks"].append(run_graph_check(engine))
        vocab = engine.model_config.vocab_size
        # compile the kernel variants (prefill tile sizes follow the longest query) and warm up
        rng = np.random.default_rng(3)
        for i, n in enumerate((2, 3, 6, 12, 24, 100, 700)):
            n = min(n, engine.config.scheduler_config.max_model_len - 8)
            warm = [rng.integers(0, vocab, size=n).tolist()] * 2
            run_requests(engine, warm, 4, deadline, f"warmup{i}")
        workloads = {"mixed": mixed_prompts(vocab, args.scale), "shared": shared_prompts(vocab, args.scale)}
        compiled = _record_triton_compiles()  # a kernel compiled inside a timed run stalls its step
        modes = [(engine.async_scheduling, "")] + ([(False, "_sync")] if args.async_ab else [])
        cascade_on = getattr(engine.runner, "use_cascade_attn", False)
        variants = [(a, cascade_on, sfx) for a, sfx in modes]
        if args.cascade_ab and cascade_on:
            variants.append((engine.async_scheduling, False, "_nocascade"))
        for name in ("mixed", "shared"):
            for shift, (async_sched, cascade, suffix) in enumerate(variants):
                if name not in only:
                    continue
                if time.perf_counter() > deadline:
                    results["skipped"].append(f"{name}{suffix}: time budget")
                    continue
                engine.async_scheduling = async_sched  # between workloads nothing is in flight
                engine.runner.use_cascade_attn = cascade
                prompts, max_new = workloads[name]
                if shift:  # same lengths and sharing, other tokens: no prefix hit on the first run's KV
                    prompts = [[(t + shift) % vocab for t in p] for p in prompts]
                log(f"{name}{suffix}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
                    f"{max_new} new each, async scheduling {async_sched}, cascade attention {cascade}")
                graphs = getattr(engine.runner, "graph_runner", None)
                cascade_before = graphs.num_cascade_replays if graphs is not None else 0
                compiled.clear()
                try:
                    results[name + suffix] = run_requests(engine, prompts, max_new, deadline, name + suffix)
                    if graphs is not None:
                        results[name + suffix]["cascade_replays"] = graphs.num_cascade_replays - cascade_before
                    results[name + suffix]["triton_compiles"] = list(compiled)
                except Exception:  # noqa: BLE001
                    results[name + suffix] = {"error": traceback.format_exc()}
                log(f"{name}{suffix}: {json.dumps(results[name + suffix])}")
        engine.runner.use_cascade_attn = cascade_on
        if args.itl_sweep:
            results["itl_sweep"] = run_itl_sweep(engine, *workloads["mixed"], deadline, ITL_CONFIGS)
        engine.async_scheduling = modes[0][0]
        if "decode" in only:
            results["decode"] = {}
            if time.perf_counter() > deadline:
                results["skipped"].append("decode: time budget")
            else:
                graphs = getattr(engine.runner, "graph_runner", None)
                mode = "eager" if graphs is None else "graphs"
                for async_sched, suffix in modes:
                    engine.async_scheduling = async_sched
                    results["decode"][mode + suffix] = run_decode(engine, vocab, args.decode_steps, deadline)
                    log(f"decode[{mode}{suffix}] {results['decode'][mode + suffix]}")
                    if args.decode_sampling:
                        key = mode + suffix + "_sampling"
                        results["decode"][key] = run_decode(engine, vocab, args.decode_steps, deadline, True)
                        log(f"decode[{key}] {results['decode'][key]}")
                engine.async_scheduling = modes[0][0]
                if args.graph_ab and graphs is not None and time.perf_counter() < deadline:
                    engine.runner.graph_runner = None
                    results["decode"]["eager"] = run_decode(engine, vocab, args.decode_steps, deadline)
                    engine.runner.graph_runner = graphs
                    log(f"decode[eager] {results['decode']['eager']}")

    results["total_s"] = time.perf_counter() - t_start
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "h200_bench.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n" + _table(results) + f"\ntotal {results['total_s']:.0f} s", flush=True)
    failed = [c for c in results.get("checks", []) if not c.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
