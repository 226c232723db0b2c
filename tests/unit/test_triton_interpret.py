"""The Triton kernels (tallyserve/attention/triton_attn.py, triton_cache.py) on the CPU under
Triton's interpreter, against the torch reference, on small random inputs.

The kernels run in ONE subprocess with ``TRITON_INTERPRET=1`` (Triton reads the variable when a
kernel is decorated, so setting it inside this pytest process would depend on import order and
leak into other tests); each case below then asserts on its own results.

Every case: mixed layouts through shuffled block tables into a NaN-filled cache; the output is
poisoned with NaN first, so a row the kernels forget to write fails; the cache written by the
Triton kernel must equal the one the torch reference writes (padding rows, slot -1, write nothing).

Needs Triton >= 3.7 (the CPU venv has 3.9): Triton 3.6's interpreter cannot run runtime-bound loops
under NumPy 2, so the kernel cases skip there (tests/gpu covers the compiled kernels on 3.6).
Triton 3.9's interpreter multiplies the raw bits of bfloat16 ``tl.dot`` operands; the worker patches
that one interpreter function (upcast to float32 first) so the bf16 case tests our kernels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import pytest

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")

# Triton 3.6's interpreter turns runtime loop bounds into ints with int() on 1-element NumPy arrays,
# which NumPy 2 rejects (fixed in later Triton); the compiled kernels are unaffected (tests/gpu).
_OLD_INTERPRETER = interpreter_too_old(triton)
needs_interpreter = pytest.mark.skipif(
    _OLD_INTERPRETER, reason=f"Triton {triton.__version__}'s interpreter cannot run runtime-bound loops; use >= 3.7")

REPO = Path(__file__).resolve().parents[2]

# name: (requests [(cached_len, query_len)], Hq, Hkv, head_dim, block_size, dtype, padding rows, KernelConfig kwargs)
CASES = {
    "mixed_gqa2_d64_fp32": ([(0, 7), (5, 1), (0, 1), (9, 6), (16, 1), (3, 13)], 4, 2, 64, 4, "float32", 3,
                            dict(block_n=16)),
    "mixed_gqa4_d128_fp32_split4_small_tiles": ([(0, 9), (40, 1), (9, 6), (70, 1), (33, 20), (1, 1)], 8, 2, 128, 16,
                                                "float32", 0, dict(block_n=16, num_splits=4, prefill_block_m=16)),
    "group6_blocksize3_split2": ([(0, 5), (23, 1), (11, 4), (30, 1)], 6, 1, 64, 3, "float32", 2,
                                 dict(block_n=16, num_splits=2)),
    "mha_d128_fp16_default_tiles": ([(100, 1), (0, 40), (70, 30), (5, 1)], 4, 4, 128, 16, "float16", 1, {}),
    "mixed_gqa4_d64_bf16_split2": ([(0, 11), (37, 1), (20, 9), (50, 1)], 8, 2, 64, 8, "bfloat16", 2,
                                   dict(block_n=16, num_splits=2)),
    "decode_only_fp32_split8": ([(60, 1), (3, 1), (0, 1), (17, 1), (99, 1)], 4, 1, 64, 16, "float32", 0,
                                dict(block_n=16, num_splits=8)),
    # both orders of the decode grid: KV heads first (the default) and requests first, split and not
    "decode_heads_first_split4": ([(60, 1), (3, 1), (0, 9), (17, 1), (99, 1)], 8, 2, 64, 16, "float32", 1,
                                  dict(block_n=16, num_splits=4, decode_heads_first=True)),
    "decode_requests_first_bf16": ([(40, 1), (7, 1), (23, 1)], 8, 4, 64, 8, "bfloat16", 0,
                                   dict(block_n=16, decode_heads_first=False)),
    "decode_requests_first_split2": ([(60, 1), (3, 1), (0, 9), (17, 1)], 8, 2, 64, 16, "float32", 0,
                                     dict(block_n=16, num_splits=2, decode_heads_first=False)),
    "head_dim_256": ([(5, 4), (20, 1)], 2, 1, 256, 8, "float32", 0, dict(block_n=16, num_splits=2)),
    "head_dim_16": ([(3, 6), (9, 1)], 4, 2, 16, 4, "float32", 1, dict(block_n=16)),
    "head_dim_80_fp16": ([(3, 6), (9, 1)], 4, 2, 80, 4, "float16", 0, dict(block_n=16, num_splits=2)),
    # CUDA-graph padding: decode requests with seq_len 0 and slot -1 must read and write nothing.
    "graph_padding_seq_len_0": ([(12, 1), (40, 1), "pad", "pad", "pad"], 4, 2, 64, 4, "float32", 0,
                                dict(block_n=16, num_splits=4)),
    # Cascade attention: decode requests whose first blocks are the same physical blocks (one set of
    # K/V); the metadata names the shared prefix and the kernels attend it once for all requests.
    "cascade_gqa4_bf16": ([(40, 1), (41, 1), (47, 1), (52, 1), (40, 1), (63, 1), (44, 1), (90, 1), (45, 1), (58, 1)],
                          8, 2, 64, 8, "bfloat16", 0,
                          dict(block_n=16, cascade_block_m=16, cascade_num_splits=2), dict(shared_blocks=5)),
    # one own key only (seq_len = prefix + 1), more prefix splits than tiles of keys, a split suffix
    "cascade_fp32_one_own_key_split_suffix": ([(32, 1), (33, 1), (32, 1), (70, 1), (35, 1), (40, 1), (32, 1), (36, 1)],
                                              4, 1, 64, 8, "float32", 0,
                                              dict(block_n=16, num_splits=2, cascade_block_m=16, cascade_num_splits=4),
                                              dict(shared_blocks=4)),
    # CUDA-graph replay: the host field is the capture bound (max_seq_len), the device tensor the
    # real length; padding requests (seq_len 0) must stay zero; group 3 rows straddle tiles
    "cascade_graph_bound_padding_group3": ([(16, 1), (19, 1), (30, 1), (17, 1), (22, 1), (16, 1), (25, 1), (18, 1),
                                            (20, 1), "pad", "pad", "pad"], 6, 2, 64, 4, "float32", 0,
                                           dict(block_n=16, cascade_block_m=16), dict(shared_blocks=4, bound=True)),
    # more partial slots (32 own + 16 prefix splits) than the reduce's default bound of 32
    "cascade_more_slots_than_max_splits": ([(40 + i, 1) for i in range(9)] + ["pad"], 4, 1, 64, 8, "float32", 0,
                                           dict(block_n=16, num_splits=32, cascade_block_m=16, cascade_num_splits=16),
                                           dict(shared_blocks=4)),
    # head_dim 40 (padded to 64) and a group of 24 query heads per KV head, taller than the 16-row tile
    "cascade_group24_head_dim40": ([(20 + 3 * i, 1) for i in range(8)], 24, 1, 40, 4, "float32", 0,
                                   dict(block_n=16, cascade_block_m=16, cascade_num_splits=3), dict(shared_blocks=5)),
}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


# --------------------------------------------------------------------------- worker (subprocess)
def _make_case(spec, seed):
    """Inputs of one step: q/k/v, a NaN-filled cache holding the cached prefixes, metadata."""
    import torch

    from tallyserve.attention.backend import get_kv_cache_shape
    from tallyserve.attention.metadata import AttentionMetadata

    reqs, hq, hkv, dim, bs, dtype_name, num_padding = spec[:7]
    cascade = spec[8] if len(spec) > 8 else {}
    shared = cascade.get("shared_blocks", 0)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    real = [r for r in reqs if r != "pad"]
    num_blocks = sum(-(-(c + n) // bs) for c, n in real) + 3
    cache = torch.full(get_kv_cache_shape(num_blocks, bs, hkv, dim), float("nan"), dtype=dtype)
    flat = cache.view(2, -1, hkv, dim)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    shared_table = [free.pop() for _ in range(shared)]
    shared_k, shared_v = (torch.randn(shared * bs, hkv, dim, generator=gen).to(dtype) for _ in range(2))
    q_rows, k_rows, v_rows, slots, starts, seq_lens, tables = [], [], [], [], [0], [], []
    for r in reqs:
        cached, new = (0, 1) if r == "pad" else r
        total = 0 if r == "pad" else cached + new
        own = 0 if r == "pad" else shared
        table = shared_table[:own] + [free.pop() for _ in range(-(-total // bs) - own)]
        tables.append(table)
        req_slots = [table[p // bs] * bs + p % bs for p in range(total)]
        k = torch.randn(max(total, 1), hkv, dim, generator=gen).to(dtype)
        v = torch.randn(max(total, 1), hkv, dim, generator=gen).to(dtype)
        k[: own * bs], v[: own * bs] = shared_k[: own * bs], shared_v[: own * bs]
        flat[0, req_slots[:cached]] = k[:cached]
        flat[1, req_slots[:cached]] = v[:cached]
        k_rows.append(k[-new:])
        v_rows.append(v[-new:])
        slots += [-1] if r == "pad" else req_slots[cached:]
        q_rows.append(torch.randn(new, hq, dim, generator=gen).to(dtype))
        starts.append(starts[-1] + new)
        seq_lens.append(total)
    pad = [torch.randn(num_padding, h, dim, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    width = max(1, max(len(t) for t in tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens), block_size=bs,
        max_query_len=max(starts[i + 1] - starts[i] for i in range(len(reqs))), max_seq_len=max(seq_lens),
        common_prefix_len=(max(seq_lens) if cascade.get("bound") else shared * bs) if shared else 0,
        prefix_kv_lens=torch.tensor([shared * bs], dtype=torch.int32) if shared else None,
    )
    q = torch.cat(q_rows + [pad[0]])
    return q, torch.cat(k_rows + [pad[1]]), torch.cat(v_rows + [pad[2]]), cache, meta


def _reference(q, cache, meta, scale, reqs):
    """Torch reference over the real requests; padding requests (seq_len 0) give zero rows."""
    import torch

    from tallyserve.attention import torch_ref
    from tallyserve.attention.metadata import AttentionMetadata

    keep = [i for i, r in enumerate(reqs) if r != "pad"]
    if len(keep) == len(reqs):
        return torch_ref.paged_attention(q, cache, meta, scale)
    out = torch.zeros_like(q)
    rows = [meta.query_start_loc_cpu[i] for i in keep]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], query_start_loc=torch.arange(len(keep) + 1, dtype=torch.int32),
        seq_lens=meta.seq_lens[keep], block_tables=meta.block_tables[keep],
        query_start_loc_cpu=tuple(range(len(keep) + 1)), seq_lens_cpu=tuple(meta.seq_lens_cpu[i] for i in keep),
        block_size=meta.block_size, max_query_len=1, max_seq_len=meta.max_seq_len,
    )
    out[rows] = torch_ref.paged_attention(q[rows], cache, sub, scale)
    return out


def _same_cache(a, b) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _run_case(name):
    import torch

    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import KernelConfig, TritonAttentionBackend, paged_attention
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    spec = CASES[name]
    q, k, v, cache, meta = _make_case(spec, seed=sorted(CASES).index(name))
    scale = spec[3] ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    torch_ref.write_kv_cache(k[: meta.num_tokens], v[: meta.num_tokens], ref_cache, meta.slot_mapping[: meta.num_tokens])
    write_kv_cache(k, v, tri_cache, meta.slot_mapping)
    ref = _reference(q, ref_cache, meta, scale, spec[0])
    out = torch.full_like(q, float("nan"))
    paged_attention(q, tri_cache, meta, scale, out=out, config=KernelConfig(**spec[7]))
    # the backend end to end (check, write, attend) on a fresh cache gives the same output
    fresh = cache.clone()
    out2 = TritonAttentionBackend(KernelConfig(**spec[7])).forward(q, k, v, fresh, meta, scale)
    # with a shared prefix: the same step without cascade attention (each request reads it itself)
    plain_err = 0.0
    if meta.common_prefix_len:
        plain = paged_attention(q, tri_cache, dataclasses.replace(meta, common_prefix_len=0, prefix_kv_lens=None),
                                scale, config=KernelConfig(**spec[7]))
        plain_err = float((out.float() - plain.float()).abs().max())
    return {
        "cache_equal": _same_cache(ref_cache, tri_cache) and _same_cache(ref_cache, fresh),
        "all_finite": bool(out.isfinite().all()),
        "max_err": float((out.float() - ref.float()).abs().nan_to_num(float("inf")).max()),
        "ref_scale": float(ref.float().abs().max()),
        "padding_zero": bool((out[meta.num_tokens:] == 0).all()),
        "backend_equal": bool(torch.equal(out, out2)),
        "dtype_ok": out2.dtype == q.dtype and out2.shape == q.shape,
        "plain_err": plain_err,
    }


def _run_tiny_model():
    """A tiny Llama (GQA, head_dim 16) through prefill, chunked prefill and decode steps in mixed
    batches: Triton backend logits vs torch backend logits."""
    import tempfile

    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import PagedKV, make_tiny_model

    from tallyserve.attention.backend import get_attn_backend
    from tallyserve.models.loader import load_model, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        resolved = resolve_model(make_tiny_model(tmp, "llama"), "auto")
        model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, None)
    steps = [[("a", list(range(3, 14))), ("b", [5, 6, 7])], [("a", [20]), ("b", list(range(30, 39))), ("c", [9] * 5)],
             [("a", [21]), ("b", [22]), ("c", [23, 24])]]
    results = {}
    for backend in ("torch", "triton"):
        for layer in model.model.layers:
            layer.self_attn.attn_backend = get_attn_backend(backend)
        kv = PagedKV(model, num_blocks=32, block_size=4, seed=1)
        results[backend] = [kv.step(batch, num_padding=2 if i == 1 else 0) for i, batch in enumerate(steps)]
    err = max(float((results["torch"][i][r] - results["triton"][i][r]).abs().max())
              for i in range(len(steps)) for r in results["torch"][i])
    finite = all(bool(t.isfinite().all()) for step in results["triton"] for t in step.values())
    return {"max_err": err, "all_finite": finite}


def _patch_interpreter_bf16_dot():
    """Triton 3.9's interpreter runs np.matmul on the uint16 bit patterns of bf16 operands."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            def up(t):
                return (t.data.astype(np.uint32) << 16).view(np.float32)
            out = np.matmul(up(a), up(b), dtype=d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _worker() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(REPO))
    _patch_interpreter_bf16_dot()
    results = {}
    for name in CASES:
        try:
            results[name] = _run_case(name)
        except Exception as exc:  # noqa: BLE001 - reported per case by the parent
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        results["tiny_model"] = _run_tiny_model()
    except Exception as exc:  # noqa: BLE001
        results["tiny_model"] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULTS " + json.dumps(results))


# --------------------------------------------------------------------------- tests (pytest process)
@pytest.fixture(scope="module")
def results():
    return run_interpreted([__file__, "--worker"], tag="RESULTS", timeout=600)


@needs_interpreter
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_match_torch_reference(results, name):
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["cache_equal"], "the Triton cache write differs from the reference (or wrote a padding row)"
    assert res["all_finite"], "an output element was not written (NaN poison survived) or is not finite"
    assert res["padding_zero"], "trailing padding rows must be zero"
    assert res["dtype_ok"]
    assert res["backend_equal"], "TritonAttentionBackend.forward differs from write + paged_attention"
    tol = TOLERANCE[CASES[name][5]] * max(1.0, res["ref_scale"])
    assert res["max_err"] <= tol, f"max abs error {res['max_err']:.3g} > {tol:.3g}"
    assert res["plain_err"] <= tol, f"cascade vs per-request kernels: {res['plain_err']:.3g} > {tol:.3g}"


@needs_interpreter
def test_tiny_model_triton_matches_torch_backend(results):
    res = results["tiny_model"]
    assert "error" not in res, res.get("error")
    assert res["all_finite"]
    assert res["max_err"] < 1e-4, res["max_err"]


def test_backend_registry():
    import torch

    from tallyserve.attention.backend import get_attn_backend
    from tallyserve.attention.triton_attn import TritonAttentionBackend

    assert isinstance(get_attn_backend("triton"), TritonAttentionBackend)
    assert get_attn_backend("triton").supports_cuda_graph
    assert get_attn_backend("auto", torch.device("cpu")).name == "cpu_sdpa"
    assert not get_attn_backend("torch").supports_cuda_graph
    if not torch.cuda.is_available():
        assert get_attn_backend("auto").name == "cpu_sdpa"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
