#!/usr/bin/env python3
"""Kernels alone: the GPU decode step's kernels, the one-row GEMV, decode attention variants, and the CPU attention
kernel's AMX and chunk paths.

    python benchmarks/kernels.py gpu-profile --batch 1 --batch 246     # where a decode step's GPU time goes
    python benchmarks/kernels.py gemv --model llama-3-8b               # one-row projections: cuBLAS vs Triton (+ PDL)
    python benchmarks/kernels.py fp8-gemm --model llama-3-8b           # FP8 products: torch._scaled_mm vs Triton
    python benchmarks/kernels.py decode-attention --batch 256 --batch 64   # decode attention KernelConfig variants
    python benchmarks/kernels.py cpu-amx-attention --threads 2 --w     # CPU prompt attention: AMX vs float32 vectors
    python benchmarks/kernels.py cpu-chunk-attention --dtype bfloat16  # CPU prompts: the kernel's chunk path vs SDPA

The GPU commands need CUDA (gpu-profile and gemv: a Hopper GPU for dependent launches); the CPU ones the compiled
CPU kernels (and AMX for cpu-amx-attention); each says so and exits when its hardware is missing.
`COMMAND --help` says what each measures and prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import _common
from _common import REPO
from h200_runs import _graph_ms

try:
    import triton
    import triton.language as tl
except ImportError:  # the GEMV benchmark needs Triton; the others do not
    triton = None

PROFILE_DOC = """Where the GPU time of a decode step goes: torch.profiler over steady decode steps at a given
batch size, on dummy weights of a real model shape.

    python benchmarks/kernels.py gpu-profile --batch 1 --batch 246 [--context 640]
    python benchmarks/kernels.py gpu-profile --batch 128 --context 64 --shared-prefix 2048 --cascade-ab

For each batch size it prints the step wall time, the GPU busy time per step (union of kernel
intervals: what is left is idle, waiting for the host) and the kernels by total time, grouped by
name. With $OUT set, the numbers are written to $OUT/kernel_profile.json."""

GEMV_DOC = """One-row projections on the GPU: cuBLAS against tallyserve's Triton GEMV (kernels/gemv.py), with and without
programmatic dependent launch, over a model preset's per-layer weights.

    python benchmarks/kernels.py gemv [--model llama-3-8b] [--layers 32]

Each projection runs once per layer over ``--layers`` distinct weight copies (so nothing is served from L2),
captured in a CUDA graph; the replay time over the bytes read gives TB/s. Also: the card's read bandwidth
(a Triton sum over 4 GiB) and a chain of the MLP and attention projections with add + RMSNorm between them,
as a decode step of one sequence runs them. With $OUT set, the numbers go to $OUT/gemv.json."""

DECODE_DOC = """Decode attention on the GPU: KernelConfig variants over a cache laid out as the engine lays it out.

    python benchmarks/kernels.py decode-attention [--batch 256 --batch 64] [--rounds 3] [--out FILE]
        [--variant NAME:key=value,key=value ...]

The cache of each batch mirrors the mixed workload of ``gpu.py`` (Llama-3-8B attention shapes:
32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16): each request has a prompt of 256-1024
tokens in consecutive blocks (a prefill allocates them together) and 0-256 decoded tokens in blocks
handed out one at a time to the requests in turn (decode steps of the whole batch), so its table is a
run of blocks and then blocks strided by the batch. ``--layout shuffled`` draws every block at random.

Each variant runs 20 calls captured in one CUDA graph (no launch gaps, as a decode step runs), the
median of 5 replays; variants are interleaved over ``--rounds`` rounds and the best round counts. The
figure is KV bytes read per second (every request's K and V, all heads) against a device-to-device
copy of 2 GiB measured in the same process. Outputs of every variant are compared with the default's."""

AMX_DOC = """The CPU attention kernel's AMX path for chunks against its float32 vector path, the kernel alone.

The bundled model's attention shapes (9 query heads, 3 KV heads, head_dim 64), a bfloat16 cache (the
``dtype="bfloat16"`` mode; ``--kv-dtype float32`` shows that the AMX path leaves a float32 cache alone), blocks of 16:
  * one prompt of each ``--lengths`` tokens, all its rows in one call (nanoseconds per query-key score);
  * W's prompt lengths (``cpu_workload.py``: 64 prompts of 32-512 tokens), every prompt in one call per layer, for
    ``--layers`` layers with a cache each.
The two paths alternate in one process (``torch.ops.tallyserve_cpu.set_amx``) over ``--rounds`` rounds; the best
time of each counts. Needs a CPU with AMX-BF16 (Sapphire Rapids or later); elsewhere it says so and exits.

    python benchmarks/kernels.py cpu-amx-attention --threads 1 --lengths 256 512 1024
    python benchmarks/kernels.py cpu-amx-attention --threads 2 --w"""

CHUNK_DOC = """Prompt time on the CPU with the attention kernel's flash path for chunks against PyTorch's fused SDPA.

The bundled model in one process; for each case the two settings run in interleaved rounds (the SDPA side sets
``cpu_sdpa.FAST_ROWS_MAX_KEYS = 0``, which sends every chunk of more than 16 rows to the SDPA paths):
  * W's prompts (``cpu_workload.py``: 64 prompts of 32-512 random token ids), ``max_tokens=1``, prefix caching off;
  * one prompt of each ``--lengths`` tokens, ``max_tokens=1`` (time to first token offline).
Prints seconds per round and the min of each setting; ``--json`` writes them.

    python benchmarks/kernels.py cpu-chunk-attention --dtype bfloat16 --rounds 3 --lengths 1030 2048 4000"""



# ============================================================================= gpu-profile
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
BODY_KERNELS = ("_gemv_kernel", "_add_rms_norm_kernel", "decode_kernel", "_rotary_write_kv_kernel", "reduce_kernel")


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


def cmd_gpu_profile(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, PROFILE_DOC)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sampling", action="store_true", help="temperature 0.8, top_p 0.95, top_k 50 instead of greedy")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra LLM kwarg, key=value (bool/int)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (before --context)")
    ap.add_argument("--cascade-ab", action="store_true", help="profile each batch again with cascade attention off")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from tallyserve import LLM

    kwargs = _common.engine_kwargs(args.engine_arg)
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


# ============================================================================= gemv
if triton is not None:
    @triton.jit
    def _read_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(o_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), 0))


def _gemv_graph_ms(fn, reps: int = 20) -> float:
    """Median replay time (ms) of ``fn`` captured in a CUDA graph (after one warm-up run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _read_bandwidth(dev: torch.device) -> float:
    """TB/s of a Triton sum over 4 GiB of bf16."""
    big = torch.randn(2 ** 31, device=dev, dtype=torch.bfloat16)
    partial = torch.empty(triton.cdiv(big.numel(), 8192), device=dev)
    ms = _gemv_graph_ms(lambda: _read_kernel[(partial.numel(),)](big, partial, big.numel(), BLOCK=8192, num_warps=8), reps=10)
    return big.numel() * 2 / ms / 1e9


def cmd_gemv(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, GEMV_DOC)
    ap.add_argument("--model", default="llama-3-8b", help="a preset of tallyserve/model_configs")
    ap.add_argument("--layers", type=int, default=32, help="distinct weight copies per projection")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("no CUDA device (or no Triton): nothing to measure")
        return 0
    from tallyserve.kernels import fused_ops, gemv

    cfg = json.loads((REPO / "tallyserve/model_configs" / f"{args.model}.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], args.layers
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_width = cfg["num_attention_heads"] * head_dim
    qkv = q_width + 2 * cfg["num_key_value_heads"] * head_dim
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "shapes": {}}

    results["read_TBps"] = _read_bandwidth(dev)
    print(f"read bandwidth {results['read_TBps']:.2f} TB/s")

    def with_pdl(flag: str, fn):
        old = os.environ.get("TALLYSERVE_PDL")
        os.environ["TALLYSERVE_PDL"] = flag
        try:
            return _gemv_graph_ms(fn)
        finally:
            os.environ.pop("TALLYSERVE_PDL") if old is None else os.environ.__setitem__("TALLYSERVE_PDL", old)

    shapes = {"qkv_proj": (qkv, hidden, False), "o_proj": (hidden, q_width, False),
              "gate_up_proj": (2 * inter, hidden, False), "down_proj (SiLU-mul input)": (hidden, inter, True)}
    weights = {}
    for name, (n, k, silu) in shapes.items():
        w = [(0.02 * torch.randn(n, k, device=dev)).to(bf16) for _ in range(layers)]
        weights[name] = w
        x = torch.randn(1, 2 * k if silu else k, device=dev, dtype=bf16)
        plain_x = fused_ops.silu_mul(x) if silu else x
        out = torch.empty(1, n, device=dev, dtype=bf16)
        nbytes = n * k * 2 * layers
        runs = {"cublas": _gemv_graph_ms(lambda: [torch.mm(plain_x, wi.t(), out=out) for wi in w]),
                "triton": with_pdl("0", lambda: [gemv.gemv(x, wi, silu_mul_input=silu) for wi in w]),
                "triton + PDL": with_pdl("1", lambda: [gemv.gemv(x, wi, silu_mul_input=silu) for wi in w])}
        row = {tag: {"us": ms * 1e3 / layers, "TBps": nbytes / ms / 1e9} for tag, ms in runs.items()}
        results["shapes"][name] = {"n": n, "k": k, **row}
        print(f"{name:28s} ({n} x {k}): " + ", ".join(f"{t} {r['us']:.2f} us {r['TBps']:.2f} TB/s" for t, r in row.items()))

    norm_w = torch.ones(hidden, device=dev, dtype=bf16)
    h0 = torch.randn(1, hidden, device=dev, dtype=bf16)
    r0 = torch.randn(1, hidden, device=dev, dtype=bf16)
    wq, wo, wgu, wd = (weights[k] for k in shapes)

    def chain(triton_gemv: bool):
        h, r = h0, r0.clone()
        for i in range(layers):
            x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
            if triton_gemv:
                h = gemv.gemv(gemv.gemv(x, wq[i])[:, :q_width].contiguous(), wo[i])
                x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
                h = gemv.gemv(gemv.gemv(x, wgu[i]), wd[i], silu_mul_input=True)
            else:
                h = F.linear(F.linear(x, wq[i])[:, :q_width].contiguous(), wo[i])
                x = fused_ops.add_rms_norm(h, r, norm_w, 1e-5)
                h = F.linear(fused_ops.silu_mul(F.linear(x, wgu[i])), wd[i])
        return h

    total = sum(n * k * 2 for n, k, _ in shapes.values()) * layers
    chains = {"cublas": with_pdl("0", lambda: chain(False)), "triton": with_pdl("0", lambda: chain(True)),
              "triton + PDL": with_pdl("1", lambda: chain(True))}
    results["chain"] = {tag: {"ms": ms, "TBps": total / ms / 1e9} for tag, ms in chains.items()}
    print(f"chain of {layers} layers ({total / 1e9:.2f} GB): " +
          ", ".join(f"{t} {r['ms']:.3f} ms {r['TBps']:.2f} TB/s" for t, r in results["chain"].items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv.json").write_text(json.dumps(results, indent=2))


# ============================================================================= decode-attention
DECODE_VARIANTS = [
    "default:",
    "heads_first:decode_heads_first=1",
    "heads_first_st2:decode_heads_first=1,decode_num_stages=2",
    "heads_first_st4:decode_heads_first=1,decode_num_stages=4",
    "heads_first_n128_st2:decode_heads_first=1,decode_block_n=128,decode_num_stages=2",
    "heads_first_n32_st4:decode_heads_first=1,decode_block_n=32,decode_num_stages=4",
    "heads_first_w8:decode_heads_first=1,decode_num_warps=8",
    "heads_first_split2:decode_heads_first=1,num_splits=2",
    "st4:decode_num_stages=4",
    "split2:num_splits=2",
]


def _parse_variant(text: str):
    from tallyserve.attention.triton_attn import KernelConfig

    name, _, body = text.partition(":")
    kwargs = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        field = {f.name: f for f in dataclasses.fields(KernelConfig)}.get(key)
        if field is None:
            raise SystemExit(f"--variant {text!r}: KernelConfig has no field {key!r}")
        kwargs[key] = value not in ("0", "false", "False") if "bool" in str(field.type) else int(value)
    return name, KernelConfig(**kwargs)


def _decode_case(batch: int, layout: str, seed: int, hq=32, hkv=8, dim=128, bs=16):
    from tallyserve.attention.backend import get_kv_cache_shape
    from tallyserve.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, 1025, batch)
    decoded = rng.integers(0, 257, batch)
    lens = (prompts + decoded).tolist()
    blocks_of = [-(-n // bs) for n in lens]
    prompt_blocks = [-(-int(p) // bs) for p in prompts]
    num_blocks = sum(blocks_of) + 8
    tables = [[] for _ in range(batch)]
    if layout == "shuffled":
        free = rng.permutation(num_blocks).tolist()
        for i in range(batch):
            tables[i] = [free.pop() for _ in range(blocks_of[i])]
    else:
        nxt = 0
        for i in range(batch):  # the prompts: a run of blocks each
            tables[i] = list(range(nxt, nxt + prompt_blocks[i]))
            nxt += prompt_blocks[i]
        while any(len(tables[i]) < blocks_of[i] for i in range(batch)):  # decode: one block per request in turn
            for i in range(batch):
                if len(tables[i]) < blocks_of[i]:
                    tables[i].append(nxt)
                    nxt += 1
    cache = torch.randn(get_kv_cache_shape(num_blocks, bs, hkv, dim), dtype=torch.bfloat16, device=dev)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_start_loc_cpu=tuple(range(batch + 1)), seq_lens_cpu=tuple(lens), block_size=bs,
        max_query_len=1, max_seq_len=max(lens),
    )
    q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device=dev)
    kv_bytes = sum(lens) * hkv * dim * 2 * 2
    return q, cache, meta, kv_bytes


def _copy_tbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = _graph_ms(lambda: dst.copy_(src), calls=5)
    return 2 * src.numel() * 2 / ms / 1e9  # read + write


def cmd_decode_attention(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, DECODE_DOC)
    ap.add_argument("--batch", type=int, action="append", default=[])
    ap.add_argument("--layout", choices=("engine", "shuffled"), default="engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="NAME:field=value,... of KernelConfig")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from tallyserve.attention.triton_attn import paged_attention

    variants = [_parse_variant(v) for v in (args.variant or DECODE_VARIANTS)]
    copy = _copy_tbps()
    print(f"device copy: {copy:.2f} TB/s (read + write)")
    report = {"copy_tbps": round(copy, 3), "layout": args.layout, "batches": {}}
    for batch in args.batch or [256, 64]:
        q, cache, meta, kv_bytes = _decode_case(batch, args.layout, seed=batch)
        outs, best = {}, {}
        for _ in range(args.rounds):
            for name, cfg in variants:
                out = torch.empty_like(q)
                ms = _graph_ms(lambda: paged_attention(q, cache, meta, 0.088, out=out, config=cfg))
                best[name] = min(best.get(name, float("inf")), ms)
                outs[name] = out
        ref = outs[variants[0][0]].float()
        rows = []
        for name, cfg in variants:
            err = float((outs[name].float() - ref).abs().max())
            rows.append({"variant": name, "ms": round(best[name], 4), "TB/s": round(kv_bytes / best[name] / 1e9, 3),
                         "max_abs_diff_vs_first": err})
            print(f"batch {batch:4d} {name:24s} {best[name]:.4f} ms  {kv_bytes / best[name] / 1e9:.3f} TB/s  "
                  f"diff {err:.2e}")
        report["batches"][str(batch)] = {"kv_gb": round(kv_bytes / 1e9, 3), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


# ============================================================================= cpu-amx-attention
AMX_HQ, AMX_HKV, AMX_D, AMX_BS = 9, 3, 64, 16


def _amx_case(lengths: list[int], layers: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // AMX_BS) for n in lengths]
    caches = [torch.randn(2, sum(blocks) + 1, AMX_BS, AMX_HKV, AMX_D, generator=gen).to(dtype) for _ in range(layers)]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    nxt = 0
    for r, nb in enumerate(blocks):  # each prompt's blocks in one run, as a prefill allocates them
        table[r, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
    q = torch.randn(sum(lengths), AMX_HQ, AMX_D, generator=gen)
    qsl = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
    return q, caches, table, qsl, torch.tensor(lengths, dtype=torch.long)


def _amx_best(fn, rounds: int) -> dict[bool, float]:
    ops = torch.ops.tallyserve_cpu
    best = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for amx in (False, True):
            ops.set_amx(amx)
            fn()  # warm
            t0 = time.perf_counter()
            fn()
            best[amx] = min(best[amx], time.perf_counter() - t0)
    ops.set_amx(True)
    return best


def cmd_cpu_amx_attention(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, AMX_DOC)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024])
    ap.add_argument("--w", action="store_true", help="also W's 64 prompt lengths over --layers layers")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tallyserve.kernels import cpu_kernels

    if not cpu_kernels.load() or not torch.ops.tallyserve_cpu.amx_usable():
        print("no AMX path here (no AMX-BF16, or the CPU kernels could not be built): nothing to compare")
        return 0
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.kv_dtype)
    op = torch.ops.tallyserve_cpu.paged_attention
    rows = []
    for n in args.lengths:
        q, caches, table, qsl, lens = _amx_case([n], 1, dtype)
        reps = max(1, 4_000_000 // (n * n))
        best = _amx_best(lambda: [op(q, caches[0], table, qsl, lens, AMX_D ** -0.5) for _ in range(reps)], args.rounds)
        scores = n * (n + 1) / 2 * AMX_HQ * reps
        row = {"case": f"one prompt of {n}", "vector_ns_per_score": best[False] / scores * 1e9,
               "amx_ns_per_score": best[True] / scores * 1e9}
        rows.append(row)
        print(f"{row['case']:>22s}: vector {row['vector_ns_per_score']:.2f} ns/score, amx "
              f"{row['amx_ns_per_score']:.2f} ns/score ({best[False] / best[True]:.2f}x)")
    if args.w:
        from benchmarks.cpu_workload import make_workload

        lengths = [len(p) for p in make_workload()]
        q, caches, table, qsl, lens = _amx_case(lengths, args.layers, dtype)
        best = _amx_best(lambda: [op(q, c, table, qsl, lens, AMX_D ** -0.5) for c in caches], args.rounds)
        rows.append({"case": f"W's {len(lengths)} prompts x {args.layers} layers", "vector_s": best[False],
                     "amx_s": best[True]})
        print(f"W's {len(lengths)} prompts x {args.layers} layers: vector {best[False]:.3f} s, amx {best[True]:.3f} s "
              f"({best[False] / best[True]:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "kv_dtype": args.kv_dtype, "rows": rows},
                                              indent=1))
    return 0


# ============================================================================= cpu-chunk-attention
def cmd_cpu_chunk_attention(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, CHUNK_DOC)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1030, 2048, 4000])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from benchmarks.cpu_workload import make_workload
    from tallyserve import LLM, SamplingParams
    from tallyserve.attention import cpu_sdpa

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(1)
    cases = {"W prompts": [{"prompt_token_ids": ids} for ids in make_workload()]}
    for n in args.lengths:
        cases[f"one prompt of {n}"] = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}]
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)  # warm-up: kernels built, pools made
    default = cpu_sdpa.FAST_ROWS_MAX_KEYS
    results: dict[str, dict[str, list[float]]] = {}
    for name, prompts in cases.items():
        times = results.setdefault(name, {"flash path": [], "sdpa": []})
        for r in range(args.rounds):
            for setting in (("flash path", "sdpa") if r % 2 == 0 else ("sdpa", "flash path")):
                cpu_sdpa.FAST_ROWS_MAX_KEYS = default if setting == "flash path" else 0
                start = time.perf_counter()
                llm.generate(prompts, params)
                times[setting].append(time.perf_counter() - start)
                print(f"{name:22s} round {r}  {setting:10s} {times[setting][-1]:.3f} s", flush=True)
        cpu_sdpa.FAST_ROWS_MAX_KEYS = default
        best = {k: min(v) for k, v in times.items()}
        print(f"{name:22s} min: flash path {best['flash path']:.3f} s, sdpa {best['sdpa']:.3f} s, "
              f"ratio {best['flash path'] / best['sdpa']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "rounds": args.rounds, "fast_rows_max_keys": default, "seconds": results},
                      f, indent=1)


FP8_DOC = """FP8 projections on the GPU (compute capability 8.9+), per shape of a model preset and per batch of rows:
torch._scaled_mm (cuBLASLt, row-wise scales) against tallyserve's Triton kernel for per-channel weights, the Triton
block-scaled kernel (128 x 128 blocks) and the bf16 product for reference, each with its activation quantization,
timed as CUDA-graph replays over distinct weight copies.

    python benchmarks/kernels.py fp8-gemm [--model llama-3-8b] [--rows 16 --rows 256 --rows 2048]

It prints, per (N, K) and rows, the milliseconds of each and the faster per-channel backend: the table that
``kernels/fp8_gemm.CHANNEL_BACKEND`` records. With $OUT set, the numbers go to $OUT/fp8_gemm.json."""


def cmd_fp8_gemm(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, FP8_DOC)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--rows", type=int, action="append", default=[])
    ap.add_argument("--copies", type=int, default=8, help="distinct weight copies per shape (out of L2)")
    args = ap.parse_args(argv)
    from tallyserve.kernels import fp8_gemm
    from tallyserve.quantization.fp8 import quantize_weight

    if not torch.cuda.is_available() or not fp8_gemm.supported(torch.device("cuda")):
        print("no CUDA device with FP8 tensor cores: nothing to measure")
        return 0
    cfg = json.loads((REPO / "tallyserve/model_configs" / f"{args.model}.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]
    rows_list = args.rows or [16, 256, 2048]
    results = []
    for n, k in shapes:
        ws = [torch.randn(n, k, device="cuda") / k ** 0.5 for _ in range(args.copies)]
        chan = [quantize_weight(w) for w in ws]
        block = [quantize_weight(w, (128, 128)) for w in ws]
        bf = [w.bfloat16() for w in ws]
        del ws
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def run(fn):
                return _gemv_graph_ms(lambda: [fn(i) for i in range(args.copies)]) / args.copies

            def scaled(i):
                q, s = fp8_gemm.quantize_rows(x)
                return fp8_gemm._scaled_mm(q, s, chan[i][0], chan[i][1], None, torch.bfloat16)

            def triton_chan(i):
                q, s = fp8_gemm.quantize_rows(x)
                return fp8_gemm.triton_gemm(q, s, chan[i][0], chan[i][1].reshape(-1, 1), None, None, torch.bfloat16, 128)

            def triton_block(i):
                q, s = fp8_gemm.quantize_rows(x, group=128)
                return fp8_gemm.triton_gemm(q, s, block[i][0], block[i][1], (128, 128), None, torch.bfloat16, 128)

            row = {"n": n, "k": k, "rows": m, "bf16_ms": run(lambda i: x @ bf[i].t()),
                   "scaled_mm_ms": run(scaled), "triton_channel_ms": run(triton_chan),
                   "triton_block_ms": run(triton_block)}
            row["channel_choice"] = "scaled_mm" if row["scaled_mm_ms"] <= row["triton_channel_ms"] else "triton"
            results.append(row)
            print(f"{n:>6} x {k:<6} rows {m:>5}: bf16 {row['bf16_ms']:.4f}  scaled_mm {row['scaled_mm_ms']:.4f}  "
                  f"triton {row['triton_channel_ms']:.4f}  block {row['triton_block_ms']:.4f} ms -> "
                  f"{row['channel_choice']}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_gemm.json").write_text(json.dumps(
            {"model": args.model, "device": torch.cuda.get_device_name(), "rows": results}, indent=2))
    return 0


COMMANDS: dict[str, _common.Command] = {
    "fp8-gemm": ("FP8 projections: torch._scaled_mm against the Triton kernels, per shape and rows", cmd_fp8_gemm),
    "gpu-profile": ("torch.profiler over steady GPU decode steps: kernels by time, the step's critical path",
                    cmd_gpu_profile),
    "gemv": ("one-row projections on the GPU: cuBLAS against the Triton GEMV, with and without dependent launch",
             cmd_gemv),
    "decode-attention": ("GPU decode attention: KernelConfig variants over an engine-shaped cache, TB/s",
                         cmd_decode_attention),
    "cpu-amx-attention": ("CPU prompt attention over a bfloat16 cache: AMX tiles against the float32 vector path",
                          cmd_cpu_amx_attention),
    "cpu-chunk-attention": ("CPU prompt time: the attention kernel's chunk path against PyTorch's SDPA",
                            cmd_cpu_chunk_attention),
}


if __name__ == "__main__":
    sys.exit(_common.run_tool(__doc__, COMMANDS))
