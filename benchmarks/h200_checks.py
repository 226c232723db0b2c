"""Card and kernel checks for benchmarks/h200_bench.py: the matmul rate and copy bandwidth, the
Triton attention kernels against the torch reference at full size, CUDA-graph replay against eager,
and an optional sweep of kernel tile options."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- micro
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


def bench_micro() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    del a, b
    nbytes = 4 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cp_ms = _median_ms(lambda: dst.copy_(src))
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
    from tallyserve.attention.triton_cache import write_kv_cache

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
    from tallyserve.attention.triton_cache import write_kv_cache

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


def run_cascade_tune() -> dict:
    """Decode attention over a shared prefix (Llama-3-8B attention shape, bf16), GPU time per layer
    from CUDA-graph replays: per-request kernels against cascade attention with several options,
    as the shared workload's decode steps (128 requests, 2048 shared tokens, 64-160 own), a full
    batch over a shorter prefix, and a small batch."""
    from tallyserve.attention.triton_attn import KernelConfig, paged_attention
    from tallyserve.attention.triton_cache import write_kv_cache

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


# ----------------------------------------------------------------------------- workloads
