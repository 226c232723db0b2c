#!/usr/bin/env python3
"""The GPU workloads on one card (H100 / H200), in one call (<= 9 minutes by default):

    python benchmarks/gpu.py [--only micro,checks,mixed,shared,decode] [--model llama-3-8b] [--with-hf]
                             [--enforce-eager] [--graph-ab] [--async-ab] [--cascade-ab] [--itl-sweep] [--pytest]

The figures against vLLM come from running vLLM's offline LLM on the same prompts in the same device call
(the vLLM anchor's `run_vllm.py CONFIG vllm`, kept outside this repository), then this tool.

Sections (in this order; each is skipped once --budget-s, default 540 s, is spent; --pytest and
--with-hf run before the engine is built, since the engine takes most of the card for its KV pool):
  micro   bf16 matmul TFLOP/s (8192^3, median of 10) and device copy bandwidth
  checks  quick GPU checks: Triton kernels vs the torch reference at Llama-3-8B attention shapes
          (mixed batch, split-K decode), and CUDA-graph replay vs eager on the real model
  tune    (only when named) sweep of kernel tile/warp/stage options, for KernelConfig defaults
  cascade (only when named) decode attention over a shared prefix: per-request kernels against cascade options
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
short table last; writes everything as JSON to $OUT/gpu.json when $OUT is set. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

import _common
from _common import REPO
from h200_runs import (
    HF_SECONDS, ITL_CONFIGS, _graph_ms, _median_ms, _record_triton_compiles, log, mixed_prompts, run_decode, run_hf,
    run_itl_sweep, run_requests, shared_prompts,
)

ROOFLINE = {"mixed_s": 6.2, "decode_step_ms": 3.8}
SECTIONS = ("micro", "checks", "mixed", "shared", "decode", "tune", "cascade")  # the last two: not by default


# ----------------------------------------------------------------------------- micro, checks, tuning
def bench_micro() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)  # noqa: F821 - pyflakes reads the del below as before the call
    del a, b
    nbytes = 4 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cp_ms = _median_ms(lambda: dst.copy_(src))  # noqa: F821 - as above
    del src, dst
    torch.cuda.empty_cache()
    return {
        "matmul_bf16_tflops": 2 * n ** 3 / (mm_ms * 1e-3) / 1e12,
        "copy_read_plus_write_tb_s": 2 * nbytes / (cp_ms * 1e-3) / 1e12,
        "copy_one_way_tb_s": nbytes / (cp_ms * 1e-3) / 1e12,
    }


# ----------------------------------------------------------------------------- checks
def _attention_case(reqs, hq, hkv, dim, bs, dtype, seed=0, num_padding=0, shared_blocks=0):
    """Mixed batch over a NaN-filled paged cache (cached prefixes pre-written through shuffled
    block tables); mirrors tests/gpu/test_triton_gpu.py::make_case. ``shared_blocks``: every
    request's first blocks are the same blocks, named in the metadata for cascade attention."""
    from tallyserve.attention.backend import get_kv_cache_shape
    from tallyserve.attention.metadata import AttentionMetadata

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in reqs) + 8
    cache = torch.full(get_kv_cache_shape(num_blocks, bs, hkv, dim), float("nan"), dtype=dtype, device=dev)
    flat = cache.view(2, -1, hkv, dim)
    free = np.random.default_rng(seed).permutation(num_blocks).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    qs, ks, vs, slots, starts, tables = [], [], [], [], [0], []
    for cached, new in reqs:
        total = cached + new
        table = shared + [free.pop() for _ in range(-(-total // bs) - len(shared))]
        tables.append(table)
        pos = torch.arange(total, device=dev)
        req_slots = torch.tensor(table, device=dev)[pos // bs] * bs + pos % bs
        k = torch.randn(total, hkv, dim, generator=gen, device=dev).to(dtype)
        v = torch.randn(total, hkv, dim, generator=gen, device=dev).to(dtype)
        flat[0, req_slots[:cached]] = k[:cached]
        flat[1, req_slots[:cached]] = v[:cached]
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots.append(req_slots[cached:])
        qs.append(torch.randn(new, hq, dim, generator=gen, device=dev).to(dtype))
        starts.append(starts[-1] + new)
    qs.append(torch.zeros(num_padding, hq, dim, device=dev, dtype=dtype))
    ks.append(torch.zeros(num_padding, hkv, dim, device=dev, dtype=dtype))
    vs.append(torch.zeros(num_padding, hkv, dim, device=dev, dtype=dtype))
    slots.append(torch.full((num_padding,), -1, device=dev))
    width = max(len(t) for t in tables)
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).long(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens), block_size=bs,
        max_query_len=max(n for _, n in reqs), max_seq_len=max(seq_lens),
        common_prefix_len=shared_blocks * bs,
        prefix_kv_lens=torch.tensor([shared_blocks * bs], dtype=torch.int32, device=dev) if shared_blocks else None,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta


def _check_attention(name, reqs, dtype=torch.bfloat16, tol=1.5e-2, num_padding=4, shared_blocks=0) -> dict:
    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    q, k, v, cache, meta = _attention_case(reqs, 32, 8, 128, 16, dtype, num_padding=num_padding,
                                           shared_blocks=shared_blocks)
    n = meta.num_tokens
    ref_cache, tri_cache = cache.clone(), cache.clone()
    torch_ref.write_kv_cache(k[:n], v[:n], ref_cache, meta.slot_mapping[:n])
    write_kv_cache(k, v, tri_cache, meta.slot_mapping)
    cache_ok = bool(torch.equal(ref_cache.isnan(), tri_cache.isnan())
                    and torch.equal(ref_cache.nan_to_num(0), tri_cache.nan_to_num(0)))
    ref = torch_ref.paged_attention(q, ref_cache, meta, 128 ** -0.5).float()
    out = torch.full_like(q, float("nan"))
    paged_attention(q, tri_cache, meta, 128 ** -0.5, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        paged_attention(q, tri_cache, meta, 128 ** -0.5, out=out)
    torch.cuda.synchronize()
    kernel_ms = (time.perf_counter() - start) / 5 * 1e3
    finite = bool(out.isfinite().all())
    err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    ok = cache_ok and finite and err <= tol
    return {"name": name, "ok": ok, "rel_err": err, "cache_ok": cache_ok, "all_written": finite,
            "kernel_ms": kernel_ms, "tokens": n}


def _check_graph_vs_eager(engine) -> dict:
    """Eager prefill of 3 requests into free blocks of the engine's pool, then one decode step
    eagerly and through the captured graph (both write the same K/V into the same slots)."""
    from tallyserve.attention.metadata import AttentionMetadata

    runner = engine.runner
    graphs = getattr(runner, "graph_runner", None)
    if graphs is None:
        return {"name": "cuda_graph_vs_eager", "ok": True, "skipped": "no graph runner (enforce_eager?)"}
    dev, bs = engine.device, runner.block_size
    lens = [100, 700, 33]
    rng = np.random.default_rng(7)
    tables, nxt = [], 0
    for L in lens:
        nb = -(-(L + 1) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)

    def meta_for(rows_per_req, seq_lens, positions):
        starts = np.concatenate([[0], np.cumsum(rows_per_req)]).tolist()
        slots = [tables[i][p // bs] * bs + p % bs for i, ps in enumerate(positions) for p in ps]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_tables=table_t,
            query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens), block_size=bs,
            max_query_len=max(rows_per_req), max_seq_len=max(seq_lens))

    vocab = engine.model_config.vocab_size
    with torch.inference_mode():
        pos = [list(range(L)) for L in lens]
        meta = meta_for(lens, lens, pos)
        ids = torch.tensor(rng.integers(0, vocab, sum(lens)), device=dev)
        runner.model(ids, torch.tensor([p for ps in pos for p in ps], device=dev), runner.kv_caches, meta)
        pos = [[L] for L in lens]
        meta = meta_for([1, 1, 1], [L + 1 for L in lens], pos)
        ids = torch.tensor(rng.integers(0, vocab, 3), device=dev)
        batch = SimpleNamespace(input_ids=ids, positions=torch.tensor(lens, device=dev), attn_meta=meta, num_tokens=3)
        if not graphs.can_run(batch):
            return {"name": "cuda_graph_vs_eager", "ok": False, "error": "graph runner refused a decode batch"}
        graph = graphs.run(batch).float().clone()
        # eager with the capture-time max_seq_len runs the same kernels (same split-K count): ~exact
        bound = dataclasses.replace(meta, max_seq_len=graphs.max_seq_len)
        same = runner.model(batch.input_ids, batch.positions, runner.kv_caches, bound).float()
        # eager as the engine runs it (split count from the real lengths): equal up to bf16 rounding
        eager = runner.model(batch.input_ids, batch.positions, runner.kv_caches, meta).float()
        err_same = float((graph - same).abs().max() / same.abs().max())
        err = float((graph - eager).abs().max() / eager.abs().max())
        logits = [runner.model.compute_logits(h.to(engine.dtype)) for h in (graph, eager)]
        argmax_same = bool((logits[0].argmax(-1) == logits[1].argmax(-1)).all())
    # (the graph pads 3 rows to its bucket of 4, so cuBLAS may round differently: bf16-level error)
    return {"name": "cuda_graph_vs_eager", "ok": err_same < 2e-2 and err < 0.1, "rel_err_same_splits": err_same,
            "rel_err_vs_engine_eager": err, "argmax_same": argmax_same}


def run_kernel_checks() -> list[dict]:
    out = []
    cases = [
        ("mixed_llama8b_bf16", [(0, 1024), (3000, 512), (100, 2048)] + [(int(c), 1) for c in
                                np.random.default_rng(0).integers(1, 4096, 64)]),
        ("decode_b1_ctx8k_splitk", [(8000, 1)]),
        ("decode_b256_ctx2k", [(int(c), 1) for c in np.random.default_rng(1).integers(1024, 2048, 256)]),
        ("cascade_b128_prefix2048", [(2048 + int(c), 1) for c in np.random.default_rng(2).integers(64, 128, 128)], 128),
    ]
    for name, reqs, *shared in cases:
        try:
            out.append(_check_attention(name, reqs, shared_blocks=shared[0] if shared else 0))
        except Exception as exc:  # noqa: BLE001 - report and go on
            out.append({"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        log(f"check {out[-1]}")
    return out


def run_graph_check(engine) -> dict:
    try:
        res = _check_graph_vs_eager(engine)
    except Exception as exc:  # noqa: BLE001
        res = {"name": "cuda_graph_vs_eager", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    log(f"check {res}")
    return res


# ----------------------------------------------------------------------------- tune
def run_tune() -> dict:
    """Sweep kernel launch options on Llama-3-8B attention shapes (bf16): decode at batch 256
    (contexts 1-2k: KV bandwidth), decode at batch 1 (8k context: split-K), and prefill of 8192
    fresh tokens (8 x 1024: TFLOP/s)."""
    from tallyserve.attention.triton_attn import KernelConfig, paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    def sweep(reqs, configs, unit):
        q, k, v, cache, meta = _attention_case(reqs, 32, 8, 128, 16, torch.bfloat16, num_padding=0)
        write_kv_cache(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        ctx = sum(meta.seq_lens_cpu)
        kv_bytes = ctx * 8 * 128 * 2 * 2
        flops = sum(4 * 32 * 128 * (n * (c + n) - n * (n - 1) / 2) for c, n in reqs)
        rows = []
        for cfg in configs:
            try:
                ms = _median_ms(lambda: paged_attention(q, cache, meta, 0.088, out=out, config=cfg), reps=10)
                rate = kv_bytes / ms / 1e9 if unit == "TB/s" else flops / ms / 1e9
                rows.append({"config": {k2: v2 for k2, v2 in dataclasses.asdict(cfg).items() if v2 is not None},
                             "ms": round(ms, 4), unit: round(rate, 2)})
            except Exception as exc:  # noqa: BLE001
                rows.append({"config": dataclasses.asdict(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
            log(f"tune {rows[-1]}")
        return rows

    rng = np.random.default_rng(5)
    dec = [KernelConfig(decode_block_n=n, decode_num_warps=w, decode_num_stages=st)
           for n, w, st in ((64, 4, None), (64, 4, 2), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 4, 2), (128, 8, 3),
                            (64, 8, 3), (32, 2, 4), (16, 2, 4))]
    res = {"decode_b256": sweep([(int(c), 1) for c in rng.integers(1024, 2048, 256)], dec, "TB/s")}
    res["decode_b1_8k"] = sweep([(8000, 1)], [KernelConfig(num_splits=sp, decode_block_n=n)
                                              for sp in (4, 8, 16, 32, 64) for n in (32, 64)], "TB/s")
    pre = [KernelConfig(prefill_block_m=m, block_n=n, prefill_num_warps=w, prefill_num_stages=st)
           for m, n, w, st in ((128, 64, 8, None), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (128, 64, 4, 3),
                               (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2), (128, 64, 8, 4))]
    res["prefill_8x1024"] = sweep([(0, 1024)] * 8, pre, "TFLOP/s")
    res["prefill_4x1024_after_3k"] = sweep([(3072, 1024)] * 4, pre[:4], "TFLOP/s")
    return res


def run_cascade_tune() -> dict:
    """Decode attention over a shared prefix (Llama-3-8B attention shape, bf16), GPU time per layer
    from CUDA-graph replays: per-request kernels against cascade attention with several options,
    as the shared workload's decode steps (128 requests, 2048 shared tokens, 64-160 own), a full
    batch over a shorter prefix, and a small batch."""
    from tallyserve.attention.triton_attn import KernelConfig, paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    rng = np.random.default_rng(7)
    res = {}
    configs = [dict()] + [dict(cascade_num_splits=sp) for sp in (2, 8, 16)] + [
        dict(cascade_block_m=128, cascade_num_warps=8), dict(cascade_block_m=128, cascade_num_warps=8, cascade_num_splits=8),
        dict(cascade_block_m=128, cascade_num_warps=4), dict(cascade_block_n=32), dict(cascade_block_n=128, cascade_num_warps=8),
        dict(cascade_num_stages=2), dict(cascade_num_stages=4), dict(decode_block_n=32), dict(decode_block_n=16),
        dict(decode_block_n=32, cascade_num_splits=8), dict(decode_num_warps=2, decode_block_n=32),
        dict(cascade_block_m=32), dict(cascade_block_m=32, cascade_num_splits=8)]
    for name, num_reqs, prefix_blocks, own in (("b128_p2048", 128, 128, (64, 160)), ("b256_p1024", 256, 64, (1, 512)),
                                               ("b16_p512", 16, 32, (1, 64))):
        reqs = [(prefix_blocks * 16 + int(rng.integers(*own)), 1) for _ in range(num_reqs)]
        q, k, v, cache, meta = _attention_case(reqs, 32, 8, 128, 16, torch.bfloat16, shared_blocks=prefix_blocks)
        write_kv_cache(k, v, cache, meta.slot_mapping)
        plain_meta = dataclasses.replace(meta, common_prefix_len=0, prefix_kv_lens=None)
        out = torch.empty_like(q)
        plain_ms = _graph_ms(lambda: paged_attention(q, cache, plain_meta, 0.088, out=out))
        plain = paged_attention(q, cache, plain_meta, 0.088).float()
        rows = [{"config": "per-request", "ms": round(plain_ms, 4)}]
        log(f"cascade {name} {rows[-1]}")
        for kw in configs:
            cfg = KernelConfig(**kw)
            try:
                ms = _graph_ms(lambda: paged_attention(q, cache, meta, 0.088, out=out, config=cfg))
                err = (paged_attention(q, cache, meta, 0.088, config=cfg).float() - plain).abs().max().item()
                rows.append({"config": kw, "ms": round(ms, 4), "speedup": round(plain_ms / ms, 2),
                             "max_abs_diff_vs_per_request": err})
            except Exception as exc:  # noqa: BLE001
                rows.append({"config": kw, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"cascade {name} {rows[-1]}")
        res[name] = rows
    return res


# ----------------------------------------------------------------------------- the run
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
            line += (f"; TTFT p50/p99 {lat['ttft_p50']:.0f}/{lat['ttft_p99']:.0f} ms, "
                     f"ITL p50/p99 {lat['itl_p50']:.1f}/{lat['itl_p99']:.1f} ms")
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


def main(argv=None) -> int:
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
    args = ap.parse_args(argv)
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
        kwargs.update(_common.engine_kwargs(args.engine_arg))
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
        (Path(out_dir) / "gpu.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n" + _table(results) + f"\ntotal {results['total_s']:.0f} s", flush=True)
    failed = [c for c in results.get("checks", []) if not c.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
