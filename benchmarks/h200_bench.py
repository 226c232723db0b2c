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
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HF_SECONDS = {"mixed": 134.6, "shared": 38.5}  # docs/benchmarks.md, H200, transformers generate_batch
ROOFLINE = {"mixed_s": 6.2, "decode_step_ms": 3.8}
SECTIONS = ("micro", "checks", "mixed", "shared", "decode", "tune", "cascade")  # the last two: not by default


from h200_checks import (  # noqa: E402
    _median_ms, bench_micro, log, run_cascade_tune, run_graph_check, run_kernel_checks, run_tune,
)


def mixed_prompts(vocab: int, scale: float):
    rng = np.random.default_rng(0)
    n = max(1, int(256 * scale))
    lo, hi = max(2, int(256 * scale)), max(3, int(1024 * scale))
    lens = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(0, vocab, size=int(L)).tolist() for L in lens], max(1, int(256 * scale))


def shared_prompts(vocab: int, scale: float):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, vocab, size=max(2, int(2048 * scale))).tolist()
    n = max(1, int(128 * scale))
    return [prefix + rng.integers(0, vocab, size=max(1, int(64 * scale))).tolist() for _ in range(n)], max(1, int(64 * scale))


def _snapshot(engine) -> dict:
    stats = engine.stats()
    graphs = getattr(engine.runner, "graph_runner", None)
    return {"stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
            "timings": dict(engine.timings), "replays": graphs.num_replays if graphs is not None else 0}


def _delta(before: dict, after: dict) -> dict:
    stats = {k: after["stats"][k] - before["stats"].get(k, 0) for k in after["stats"]
             if k not in ("num_free_blocks", "num_total_blocks", "num_cached_blocks", "num_running", "num_waiting")}
    timings = {k: round(after["timings"][k] - before["timings"].get(k, 0.0), 4) for k in after["timings"]}
    return {"stats": stats, "timings_s": timings, "graph_replays": after["replays"] - before["replays"]}


def run_requests(engine, prompts, max_tokens: int, deadline: float, tag: str) -> dict:
    """Add every prompt, step until all finish (or the deadline: then abort the rest)."""
    from tallyserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = _snapshot(engine)
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done, out_tokens, timed_out = set(), 0, False
    runner, seen, step_log = engine.runner, [], []
    forward = runner._forward

    def traced(batch, *a, **kw):  # what each forward was: for the step-time profile below
        m = batch.attn_meta
        graphs = getattr(runner, "graph_runner", None)
        seen.append((m.num_reqs, batch.num_tokens, m.max_query_len,
                     bool(graphs is not None and graphs.can_run(batch))))
        return forward(batch, *a, **kw)

    runner._forward = traced
    token_times: dict = {}  # request -> when each of its tokens reached the output (as a stream would send it)
    emit = engine._emit_tokens

    def timed_emit(seq, samples):
        before_n = seq.num_emitted
        emit(seq, samples)
        now = time.perf_counter()
        token_times.setdefault(seq.request.request_id, []).extend([now] * (seq.num_emitted - before_n))

    engine._emit_tokens = timed_emit
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = engine.step()
        if seen:
            step_log.append(seen.pop() + (time.perf_counter() - t_step,))
            seen.clear()
        for out in outs:
            if out.finished and out.request_id not in done:
                done.add(out.request_id)
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
        if time.perf_counter() > deadline:
            timed_out = True
            engine.abort_request([r for r in ids if r not in done])
            engine.step()
            break
    wall = time.perf_counter() - start
    del runner._forward  # the method again
    del engine._emit_tokens
    prompt_tokens = sum(len(p) for p in prompts)
    res = {"requests": len(prompts), "completed": len(done), "prompt_tokens": prompt_tokens,
           "output_tokens": out_tokens, "wall_s": wall, "total_tok_s": (prompt_tokens + out_tokens) / wall,
           "output_tok_s": out_tokens / wall, "timed_out": timed_out}
    res.update(_delta(before, _snapshot(engine)))
    res["step_profile"] = _step_profile(step_log)
    res["latency_ms"] = _latencies(token_times, start)
    s = res["stats"]
    res["ledger_ok"] = (s.get("scheduled_tokens") == s.get("forward_tokens")
                        and s.get("ledger_violations", 0) == 0 and s.get("step_errors", 0) == 0)
    return res


def _latencies(token_times: dict, start: float) -> dict:
    """TTFT (from the moment every request was added) and inter-token latency percentiles, ms."""
    ttft = [t[0] - start for t in token_times.values() if t]
    itl = [b - a for t in token_times.values() for a, b in zip(t, t[1:])]
    if not ttft:
        return {}
    pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1e3, 2)  # noqa: E731
    out = {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99)}
    if itl:
        out.update(itl_p50=pct(itl, 50), itl_p99=pct(itl, 99), itl_max=round(max(itl) * 1e3, 2))
    return out


def run_itl_sweep(engine, prompts, max_new: int, deadline: float, configs) -> list:
    """The mixed workload (all requests at once) under each scheduler setting: throughput against
    inter-token latency. ``configs``: dicts of SchedulerConfig fields (max_num_batched_tokens and the
    partial prefill knobs), applied to the live scheduler between runs (nothing is in flight then)."""
    import dataclasses

    from tallyserve.core.partial_prefill import PartialPrefillPolicy

    sched = engine.scheduler
    base = sched.config
    rows = []
    for i, kw in enumerate(configs):
        if time.perf_counter() > deadline:
            rows.append({"config": kw, "skipped": "time budget"})
            continue
        sched.config = dataclasses.replace(base, **kw)
        sched.prefills = PartialPrefillPolicy(sched.config)
        shifted = [[(t + 17 + i) % engine.model_config.vocab_size for t in p] for p in prompts]
        try:
            r = run_requests(engine, shifted, max_new, deadline, f"itl{i}")
            rows.append({"config": kw, "wall_s": round(r["wall_s"], 3), "total_tok_s": round(r["total_tok_s"]),
                         "ledger_ok": r["ledger_ok"], **r["latency_ms"]})
        except Exception:  # noqa: BLE001
            rows.append({"config": kw, "error": traceback.format_exc()[-800:]})
        finally:
            sched.config = base
            sched.prefills = PartialPrefillPolicy(base)
        log(f"itl {rows[-1]}")
    return rows


ITL_CONFIGS = (
    {},
    {"max_num_batched_tokens": 4096},
    {"max_num_batched_tokens": 2048},
    {"max_num_batched_tokens": 1024},
    {"max_num_batched_tokens": 2048, "max_num_partial_prefills": 4, "long_prefill_token_threshold": 512},
)


def _record_triton_compiles() -> list:
    """A list that collects the name of every Triton kernel compiled from now on (empty if this
    Triton has no compile hook)."""
    compiled: list = []
    try:
        from triton import knobs
    except ImportError:
        return compiled

    def hook(*args, **kwargs):
        compiled.append(str(kwargs.get("repr", ""))[:160])
        return False

    if hasattr(knobs.runtime, "jit_post_compile_hook"):
        knobs.runtime.jit_post_compile_hook = hook
    return compiled


def _step_profile(step_log) -> dict:
    """Steps grouped as decode-only through a CUDA graph, decode-only eager, or with prefill rows:
    count, total seconds, median ms, mean requests and tokens (step wall time, sampler sync included).
    Under async scheduling the ``engine.step()`` that launches a forward also waits for the step
    before it, so the first decode step after a prefill step carries that prefill's time."""
    groups: dict = {}
    for num_reqs, num_tokens, max_q, graph, secs in step_log:
        kind = "decode_graph" if graph else ("decode_eager" if max_q == 1 else "with_prefill")
        groups.setdefault(kind, []).append((num_reqs, num_tokens, secs))
    out = {"slowest": [{"reqs": r, "tokens": t, "max_query_len": q, "graph": g, "ms": round(x * 1e3, 1)}
                       for r, t, q, g, x in sorted(step_log, key=lambda e: -e[-1])[:6]]}
    for kind, rows in groups.items():
        secs = [r[2] for r in rows]
        out[kind] = {"steps": len(rows), "total_s": round(sum(secs), 3), "median_ms": round(statistics.median(secs) * 1e3, 2),
                     "mean_reqs": round(sum(r[0] for r in rows) / len(rows), 1),
                     "mean_tokens": round(sum(r[1] for r in rows) / len(rows), 1)}
    return out


def run_decode(engine, vocab: int, steps: int, deadline: float, sampling: bool = False) -> dict:
    from tallyserve import SamplingParams

    room = engine.config.scheduler_config.max_model_len - steps - 2
    prompt = np.random.default_rng(2).integers(0, vocab, size=max(1, min(512, room))).tolist()
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    if sampling:  # what chat clients send: the filters run on the device every step
        params = SamplingParams(max_tokens=steps + 1, temperature=0.8, top_p=0.95, top_k=50, seed=0, ignore_eos=True)
    rid = f"decode-{time.monotonic_ns()}"
    before = dict(engine.timings)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if engine.has_unfinished_requests():
        engine.abort_request(rid)
        engine.step()
    decode = times[1:]  # the first step is the prefill
    after = dict(engine.timings)
    res = {"prefill_step_ms": times[0] * 1e3 if times else None, "decode_steps": len(decode),
           "median_step_ms": statistics.median(decode) * 1e3 if decode else None,
           "p90_step_ms": float(np.percentile(decode, 90)) * 1e3 if decode else None,
           # wall time per generated token once steady (async: each step() waits for the step before)
           "mean_step_ms": float(np.mean(times[2:])) * 1e3 if len(times) > 2 else None,
           "timings_ms_per_step": {k: round((after[k] - before[k]) * 1e3 / max(1, len(times)), 3) for k in after}}
    graphs = getattr(engine.runner, "graph_runner", None)
    if graphs is not None and 1 in graphs.graphs:
        with torch.inference_mode():
            graphs._reset_padding(0, 1)  # a padding row: writes nothing, reads nothing
        res["gpu_graph_replay_b1_ms"] = _median_ms(graphs.graphs[1].replay, reps=20)
    return res


# ----------------------------------------------------------------------------- Hugging Face
def run_hf(model_name: str, workloads: dict, deadline: float) -> dict:
    import transformers
    from transformers import GenerationConfig

    cfg_path = REPO / "tallyserve" / "model_configs" / f"{model_name}.json"
    config = transformers.AutoConfig.for_model(**json.loads(cfg_path.read_text()))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    out = {"transformers": transformers.__version__}
    for name, (prompts, max_new) in workloads.items():
        expected = HF_SECONDS[name] * 1.3 * len(prompts) * max_new / {"mixed": 65536, "shared": 8192}[name]
        if time.perf_counter() + expected > deadline:  # generate_batch cannot be interrupted
            out[name] = {"skipped": f"time budget (needs about {expected:.0f} s)"}
            continue
        gen_cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            # no inference_mode here: HF's generation thread updates tensors in place
            res = model.generate_batch(inputs=prompts, generation_config=gen_cfg, progress_bar=False)
            wall = time.perf_counter() - start
            gen = sum(len(getattr(r, "generated_tokens", []) or []) for r in res.values())
            out[name] = {"wall_s": wall, "output_tokens": gen,
                         "total_tok_s": (sum(len(p) for p in prompts) + gen) / wall}
            if gen < len(prompts) * max_new:
                out[name]["error"] = f"HF generated {gen} of {len(prompts) * max_new} tokens (see its log above)"
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"HF {name}: {out[name]}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- main
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
