"""Where the GPU time of a decode step goes: torch.profiler over steady decode steps at a given
batch size, on dummy weights of a real model shape.

    PYTHONPATH=$PWD python3 benchmarks/kernel_profile.py --batch 1 --batch 246 [--context 640]
    PYTHONPATH=$PWD python3 benchmarks/kernel_profile.py --batch 128 --context 64 --shared-prefix 2048 --cascade-ab

For each batch size it prints the step wall time, the GPU busy time per step (union of kernel
intervals: what is left is idle, waiting for the host) and the kernels by total time, grouped by
name. With $OUT set, the numbers are written to $OUT/kernel_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _busy_us(events) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def profile_batch(llm, batch: int, context: int, steps: int, sampling: bool = False, shared_prefix: int = 0,
                  tag: str = "") -> dict:
    """``shared_prefix``: every prompt starts with the same that many tokens (then ``context`` own ones)."""
    from tallyserve import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(batch)
    prefix = rng.integers(0, vocab, size=shared_prefix).tolist()
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    if sampling:
        params = SamplingParams(max_tokens=steps + 40, temperature=0.8, top_p=0.95, top_k=50, seed=0, ignore_eos=True)
    ids = [f"p{tag}{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": prefix + rng.integers(0, vocab, size=context).tolist()}, params)
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # steady decode
        engine.step()
    _sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    host_ops = sorted(((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])[:15]
    timeline = _step_timeline(kernels)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch": batch, "context": context, "shared_prefix": shared_prefix, "steps": steps, "run": tag,
        "step_ms": wall * 1e3 / steps,
        "gpu_busy_ms_per_step": _busy_us(kernels) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "top_kernels_ms_per_step": [(name[:90], round(us / 1e3 / steps, 3)) for name, us in top],
        "top_host_ops_self_ms_per_step": [(name[:90], round(us / 1e3 / steps, 3)) for name, us in host_ops],
        "step_timeline": timeline,
    }


# the kernels of a decode graph's body: everything else in a step is the work around the graph
BODY_KERNELS = ("_gemv_kernel", "_add_rms_norm_kernel", "_decode_kernel", "_rotary_write_kv_kernel", "_reduce_kernel")


def _step_timeline(kernels) -> dict:
    """One steady step, from the start of one embedding lookup (a graph's first kernel) to the next:
    every kernel outside the graph body with its start (us from the step's start), duration and the
    idle gap before it; and the idle time inside and outside the body."""
    events = sorted(kernels, key=lambda e: e.time_range.start)
    starts = [i for i, e in enumerate(events) if "indexSelect" in e.name or "embedding" in e.name.lower()]
    if len(starts) < 3:
        return {}
    i0, i1 = starts[-3], starts[-2]
    t0, prev_end, rows, idle_body, idle_other = events[i0].time_range.start, events[i0].time_range.start, [], 0.0, 0.0
    marginal: dict[str, float] = {}  # how far each kernel moves the step's end: the critical path by kernel
    for e in events[i0:i1]:
        key = next((k for k in BODY_KERNELS if k in e.name), e.name[:40])
        marginal[key] = marginal.get(key, 0.0) + max(0.0, e.time_range.end - prev_end)
        prev_end = max(prev_end, e.time_range.end)
    prev_end = t0
    for e in events[i0:i1 + 1]:
        gap = max(0.0, e.time_range.start - prev_end)
        body = any(k in e.name for k in BODY_KERNELS)
        if body:
            idle_body += gap
        else:
            idle_other += gap
            rows.append((e.name[:70], round(e.time_range.start - t0, 1), round(e.time_range.end - e.time_range.start, 1),
                         round(gap, 1)))
        prev_end = max(prev_end, e.time_range.end)
    return {"step_us": round(events[i1].time_range.start - t0, 1), "idle_before_body_kernels_us": round(idle_body, 1),
            "idle_before_other_kernels_us": round(idle_other, 1),
            "critical_path_us_by_kernel": {k: round(v, 1) for k, v in sorted(marginal.items(), key=lambda kv: -kv[1])},
            "other_kernels (name, start us, duration us, idle before us)": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sampling", action="store_true", help="temperature 0.8, top_p 0.95, top_k 50 instead of greedy")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra LLM kwarg, key=value (bool/int)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (before --context)")
    ap.add_argument("--cascade-ab", action="store_true", help="profile each batch again with cascade attention off")
    args = ap.parse_args()
    from tallyserve import LLM

    kwargs = {}
    for kv in args.engine_arg:
        key, val = kv.split("=", 1)
        kwargs[key] = val.lower() == "true" if val.lower() in ("true", "false") else int(val)
    llm = LLM(model=args.model, load_format="dummy", **kwargs)
    runner = llm.engine.runner
    cascade_on = getattr(runner, "use_cascade_attn", False)
    results = []
    for b in args.batch or [1]:
        for cascade in (cascade_on, False) if args.cascade_ab and cascade_on else (cascade_on,):
            runner.use_cascade_attn = cascade
            results.append(profile_batch(llm, b, args.context, args.steps, args.sampling, args.shared_prefix,
                                         tag="cascade" if cascade else "plain"))
    runner.use_cascade_attn = cascade_on
    for r in results:
        print(f"[{r['run']}] batch {r['batch']} ctx {r['shared_prefix']}+{r['context']}: step {r['step_ms']:.2f} ms, GPU busy "
              f"{r['gpu_busy_ms_per_step']:.2f} ms, {r['kernels_per_step']:.0f} kernels/step")
        for name, ms in r["top_kernels_ms_per_step"]:
            print(f"    {ms:8.3f} ms  {name}")
        print("  host ops by self CPU time:")
        for name, ms in r["top_host_ops_self_ms_per_step"]:
            print(f"    {ms:8.3f} ms  {name}")
        tl = r["step_timeline"]
        if tl:
            print(f"  one step: {tl['step_us']} us; idle before body kernels {tl['idle_before_body_kernels_us']} us, "
                  f"before the others {tl['idle_before_other_kernels_us']} us; the others (start, duration, idle before, us):")
            for name, start, dur, gap in tl["other_kernels (name, start us, duration us, idle before us)"]:
                print(f"    {start:9.1f} {dur:7.1f} {gap:7.1f}  {name}")
            print("  the step's critical path by kernel (us): " + ", ".join(
                f"{k} {v}" for k, v in list(tl["critical_path_us_by_kernel"].items())[:10]))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernel_profile.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
