"""The GPU workloads of ``benchmarks/gpu.py`` (and ``serving.py fidelity``) and how they run on an engine: prompts, a
timed run of requests (step profile, TTFT / inter-token latency, Triton compiles inside it), the ITL sweep over
scheduler settings, batch-1 decode, transformers' continuous batching for comparison, and the CUDA timing helpers.
(The name is historical: the tests import it as ``h200_runs``.)"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tallyserve.engine.gc_heap import frozen_heap  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _median_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graph_ms(fn, calls: int = 20, reps: int = 5) -> float:
    """GPU milliseconds of one ``fn()``: ``calls`` of them captured in one CUDA graph (no launch
    overhead, as decode steps run), median of ``reps`` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _median_ms(graph.replay, reps=reps, warmup=1) / calls

HF_SECONDS = {"mixed": 134.6, "shared": 38.5}  # H200, transformers generate_batch (2026-11-29)


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


def _allocator_counts() -> dict:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")}


def run_requests(engine, prompts, max_tokens: int, deadline: float, tag: str, record_steps: bool = False) -> dict:
    """Add every prompt, step until all finish (or the deadline: then abort the rest).
    ``record_steps``: also return every launched step (``steps``: its shape, host launch time,
    when its results were in and the period since the step before's) and each request's TTFT
    (``ttft_s``, in prompt order), for benchmarks/sim_fidelity.py."""
    from tallyserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = _snapshot(engine)
    alloc_before = _allocator_counts()
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    loop_start = time.perf_counter()
    steps = _StepRecorder(engine.core, start) if record_steps else None
    done = set()
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
    emit = engine.output.emit

    def timed_emit(seq, samples):
        before_n = seq.num_emitted
        emit(seq, samples)
        now = time.perf_counter()
        token_times.setdefault(seq.request.request_id, []).extend([now] * (seq.num_emitted - before_n))

    engine.output.emit = timed_emit
    # The engine's own loops (LLM.generate, the async server) step with the heap frozen
    # (engine/gc_heap.py): a full collection walking the engine's long-lived objects stalls the host
    # 150-270 ms (two such stalls in the H200 run of s12: one delayed 11 requests' first tokens by
    # 142 ms, one added 256 ms to a decode step). This loop steps the engine itself, so it freezes
    # the heap as they do, and notes every collection that still runs (``gc_pauses``).
    gc_pauses, gc_t0, out_tokens_box, timed_out_box = [], [0.0], [0], [False]

    def gc_note(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            now = time.perf_counter()
            gc_pauses.append({"gen": info.get("generation"), "at_s": round(gc_t0[0] - start, 6),
                              "ms": round((now - gc_t0[0]) * 1e3, 3)})

    gc.callbacks.append(gc_note)
    with frozen_heap():
        try:
            _step_loop(engine, ids, done, seen, step_log, deadline, out_tokens_box, timed_out_box)
        finally:
            gc.callbacks.remove(gc_note)
    out_tokens, timed_out = out_tokens_box[0], timed_out_box[0]
    wall = time.perf_counter() - start
    del runner._forward  # the method again
    del engine.output.emit
    if steps is not None:
        steps.stop()
    prompt_tokens = sum(len(p) for p in prompts)
    res = {"requests": len(prompts), "completed": len(done), "prompt_tokens": prompt_tokens,
           "output_tokens": out_tokens, "wall_s": wall, "total_tok_s": (prompt_tokens + out_tokens) / wall,
           "output_tok_s": out_tokens / wall, "timed_out": timed_out}
    res.update(_delta(before, _snapshot(engine)))
    res["step_profile"] = _step_profile(step_log)
    res["latency_ms"] = _latencies(token_times, start)
    res["gc_pauses"] = gc_pauses  # collections during the loop (gen 2: a full one), when and how long
    res["add_s"] = loop_start - start  # adding the requests, before the first step (in every TTFT)
    if steps is not None:
        res["steps"] = steps.records(engine, loop_start - start)
        res["ttft_s"] = [token_times[rid][0] - start if token_times.get(rid) else None for rid in ids]
    # the caching allocator during the run: retries (it freed its cache and asked the driver again,
    # a device sync each) and driver allocations show a step that paid for memory
    res["cuda_allocator"] = {k: v - alloc_before.get(k, 0) for k, v in _allocator_counts().items()}
    s = res["stats"]
    res["ledger_ok"] = (s.get("scheduled_tokens") == s.get("forward_tokens")
                        and s.get("ledger_violations", 0) == 0 and s.get("step_errors", 0) == 0)
    return res



def _step_loop(engine, ids, done, seen, step_log, deadline, out_tokens_box, timed_out_box) -> None:
    """Step until every request finished (or the deadline: then abort the rest)."""
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = engine.step()
        if seen:
            step_log.append(seen.pop() + (time.perf_counter() - t_step,))
            seen.clear()
        for out in outs:
            if out.finished and out.request_id not in done:
                done.add(out.request_id)
                out_tokens_box[0] += sum(len(c.token_ids) for c in out.outputs)
        if time.perf_counter() > deadline:
            timed_out_box[0] = True
            engine.abort_request([r for r in ids if r not in done])
            engine.step()
            break

class _StepRecorder:
    """Wraps an EngineCore's launch and completion to note, per launched step, its SchedulerOutput,
    whether a step was in flight when it launched, its host launch time (transfers, batch build,
    ledger check, forward and sampling queued) and when its results reached the host (before the
    scheduler's update). Seconds are since ``start``; the shapes are computed after the run."""

    def __init__(self, core, start: float) -> None:
        self.core, self.start = core, start
        self.launched: dict = {}  # step id -> (SchedulerOutput, overlapped, launch start, launch seconds)
        self.results: dict = {}  # step id -> when its results were in
        launch, complete = core._launch, core._complete

        def timed_launch(so, scheduled):
            overlapped = core.inflight is not None
            t0 = time.perf_counter()
            out = launch(so, scheduled)
            self.launched[so.step_id] = (so, overlapped, t0 - start, time.perf_counter() - t0)
            return out

        def timed_complete(launched):
            t0, wait0 = time.perf_counter(), core.timings["wait"]
            out = complete(launched)
            self.results[launched.so.step_id] = t0 + core.timings["wait"] - wait0 - start
            return out

        core._launch, core._complete = timed_launch, timed_complete

    def stop(self) -> None:
        del self.core._launch, self.core._complete  # the methods again

    def records(self, engine, loop_start_s: float) -> list:
        from dataclasses import asdict

        from tallyserve.sim.cost_model import StepShape

        block_size = engine.config.cache_config.block_size
        cascade = bool(getattr(engine.runner, "use_cascade_attn", False))
        out, prev_done = [], loop_start_s
        for sid in sorted(self.launched):
            so, overlapped, at, launch_s = self.launched[sid]
            done = self.results.get(sid)
            shape = StepShape.of(so, block_size, cascade)
            prefill = sum(e.num_tokens for e in so.requests if e.num_tokens > 1)
            kind = ("decode" if shape.num_decode_rows == shape.num_requests
                    else "prefill" if shape.num_decode_rows == 0 else "mixed")
            out.append({"step": sid, "kind": kind, "reqs": shape.num_requests, "tokens": shape.num_tokens,
                        "prefill_tokens": prefill, "kv_read_tokens": shape.kv_read_tokens,
                        "overlapped": overlapped, "launch_at_s": round(at, 6), "launch_ms": round(launch_s * 1e3, 3),
                        "done_s": None if done is None else round(done, 6),
                        "period_ms": None if done is None else round((done - prev_done) * 1e3, 3),
                        "rows": [(e.request_id, e.num_tokens, e.start_position) for e in so.requests],
                        "shape": asdict(shape)})
            if done is not None:
                prev_done = done
        return out


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
    order = sorted(range(len(step_log)), key=lambda i: -step_log[i][-1])[:6]
    out = {"slowest": [{"step": i, "reqs": r, "tokens": t, "max_query_len": q, "graph": g, "ms": round(x * 1e3, 1)}
                       for i in order for r, t, q, g, x in [step_log[i]]]}
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
            graphs._reset_padding(1, 0)  # a padding row: writes nothing, reads nothing
        res["gpu_graph_replay_b1_ms"] = _median_ms(graphs.graphs[1].replay, reps=20)
        res["graph_b1_includes_lm_head"] = 1 in graphs.logits_outputs  # the replay then computes the logits too
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
