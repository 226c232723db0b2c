"""The CPU attention backend (block gathers + fused SDPA) against a dense causal attention, on
caches whose unwritten slots hold large stale values: fresh prefills, chunked prefills over a cached prefix,
decode rows batched with other lengths, padding rows, GQA, bf16 caches, and the split of long
queries / big decode batches into bounded pieces."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

import tallyserve.attention.cpu_sdpa as cpu_sdpa
from tallyserve.attention.backend import get_attn_backend
from tallyserve.attention.cpu_sdpa import CpuSdpaBackend
from tallyserve.kernels import cpu_kernels
from tests.kernel_errors import RAW_THROW
from tests.unit.test_attention_ref import dense_causal_attention, make_case

KERNEL = cpu_kernels.load()


WIDEST = torch.ops.tallyserve_cpu.vector_width() if KERNEL else 0
# the kernel's head_dim-64 vector paths this build has: 16 lanes (AVX-512), 8 (AVX2 + FMA), 0 (the generic loop)
WIDTHS = [w for w in (16, 8, 0) if KERNEL and torch.ops.tallyserve_cpu.set_vector_width(w) == w]
if KERNEL:
    torch.ops.tallyserve_cpu.set_vector_width(WIDEST)


PATHS = ["kernel", "kernel-avx2", "kernel-generic", "gather"]


def _use_path(name, monkeypatch):
    """Run on one float32 path: the compiled in-place kernel on its widest vector path, on the AVX2 path or on its
    generic loop (where the build is wider), or the gather + SDPA one."""
    if name.startswith("kernel") and not KERNEL:
        pytest.skip("the CPU kernels could not be built here")
    width = {"kernel": WIDEST, "kernel-avx2": 8, "kernel-generic": 0}.get(name)
    if width is not None and width not in WIDTHS:
        pytest.skip(f"this build has no {width}-lane path")
    if name != "kernel" and width == WIDEST:
        pytest.skip("the same path as 'kernel' in this build")
    if name == "gather":
        monkeypatch.setattr(cpu_sdpa, "_use_kernel", lambda q, kv: False)
    if width is not None:
        torch.ops.tallyserve_cpu.set_vector_width(width)
        monkeypatch.setattr(cpu_sdpa, "_fast_rows", [width > 0])
        cpu_sdpa._last_plan[:] = [None, None, None]
    yield name
    if width is not None:
        torch.ops.tallyserve_cpu.set_vector_width(WIDEST)
        cpu_sdpa._last_plan[:] = [None, None, None]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """A case whose answer any float32 path computes runs on each of them."""
    yield from _use_path(request.param, monkeypatch)


@pytest.fixture(params=PATHS[:3])
def kernel_path(request, monkeypatch):
    """The compiled kernel's own contract or routing: each of its vector paths."""
    yield from _use_path(request.param, monkeypatch)


@pytest.fixture(params=["kernel", "kernel-avx2"])
def flash_rows_path(request, monkeypatch):
    """The kernel's flash path for chunks (head_dim 64 on a vector path: AVX-512 or AVX2)."""
    yield from _use_path(request.param, monkeypatch)


@pytest.fixture(params=["kernel", "gather"])
def route(request, monkeypatch):
    """Behaviour of the Python side that differs between the kernel's route (its plan's checks, the kernel's cache
    write) and the gather + SDPA route, but not between the kernel's vector paths."""
    yield from _use_path(request.param, monkeypatch)


def check(reqs, hq, hkv, d, block_size, dtype=torch.float32, atol=1e-5, seed=0, num_padding=0):
    q, k, v, cache, meta, full_k, full_v = make_case(reqs, hq, hkv, d, block_size, dtype, seed, num_padding)
    # Slots nobody wrote hold stale finite values here (the runner's caches start at zero and this
    # backend writes only finite rows): large ones, so a read past a length would show.
    stale = 1e4 * torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    cache.copy_(torch.where(cache.isnan(), stale, cache))
    scale = d ** -0.5
    out = CpuSdpaBackend().forward(q, k, v, cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    for i, (_, new) in enumerate(reqs):
        lo = meta.query_start_loc_cpu[i]
        ref = dense_causal_attention(q[lo:lo + new], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[lo:lo + new].float(), ref, atol=atol, rtol=0, msg=f"request {i}")
    if num_padding:
        assert (out[meta.num_tokens:] == 0).all()


def test_the_kernel_builds_where_a_compiler_is():
    """CI machines have g++: the kernel path must be the one tested there, not silently skipped (unless the
    load-time probe found that an error thrown in the kernels does not reach Python on this host)."""
    import shutil
    if shutil.which("c++") or shutil.which("g++"):
        assert KERNEL or cpu_kernels.errors_cross() is False


def test_kernel_path_refuses_bad_block_ids_before_the_kernel(route):
    """A block id outside the cache is a ValueError from the Python checks (the plan's validate), on the kernel's
    paths; the gather path's index_select refuses it itself."""
    q, k, v, cache, meta, _, _ = make_case([(3, 1)], 4, 2, 32, 4, seed=1)
    bad = meta.block_tables.clone().to(torch.int32)
    bad[0, 0] = cache.shape[1]
    error = ValueError if route == "kernel" else (IndexError, RuntimeError)
    with pytest.raises(error, match="block id out of range" if route == "kernel" else None):
        CpuSdpaBackend().forward(q, k, v, cache, dataclasses.replace(meta, block_tables=bad), 0.1)


@RAW_THROW
def test_kernel_refuses_bad_block_ids():
    q, k, v, cache, meta, _, _ = make_case([(3, 1)], 4, 2, 32, 4, seed=1)
    bad = meta.block_tables.clone().to(torch.int32)
    bad[0, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.tallyserve_cpu.paged_attention(q.contiguous(), cache, bad, torch.tensor([0, 1]), torch.tensor([4]),
                                                 0.1)


def test_auto_picks_it_on_the_cpu():
    assert get_attn_backend("auto", "cpu").name == "cpu_sdpa"
    assert get_attn_backend("torch").name == "torch"


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (9, 3), (6, 1)])
def test_mixed_prefill_and_decode(path, hq, hkv):
    reqs = [(0, 7), (5, 1), (0, 1), (9, 6), (16, 1), (3, 13), (40, 1)]
    check(reqs, hq, hkv, 64, block_size=4, seed=hq + hkv, num_padding=2)


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts(path, seed):
    rng = random.Random(seed)
    reqs = [(rng.choice([0, rng.randint(1, 50)]), rng.choice([1, 1, rng.randint(1, 24)]))
            for _ in range(rng.randint(1, 8))]
    check(reqs, 8, 2, 64, rng.choice([1, 3, 16]), seed=seed, num_padding=rng.randint(0, 3))


def test_bfloat16_cache_computed_in_float32():
    """bfloat16 queries over a bfloat16 cache: no kernel path takes them (they are for float32 queries), so this
    runs once, on the gather + SDPA path."""
    q, _, _, cache, _, _, _ = make_case([(0, 1)], 8, 2, 64, 4, dtype=torch.bfloat16)
    assert not cpu_sdpa._use_kernel(q, cache)
    check([(0, 9), (12, 1), (5, 4)], 8, 2, 64, 4, dtype=torch.bfloat16, atol=2e-2, seed=3)


@pytest.mark.parametrize("reqs,d,block_size", [
    ([(0, 9), (12, 1), (5, 4), (0, 1), (30, 1)], 64, 4),  # fresh prefill, decode rows, a chunk over a prefix
    ([(37, 1)], 64, 16),  # one decoding sequence: the kernel's register path, split by KV head group
    ([(200, 1), (3, 2)], 32, 16),
    ([(0, 40)], 64, 16),  # a whole prompt in one chunk: the fused causal SDPA over the fresh rows
    ([(30, 40), (5, 1)], 64, 16),  # a long chunk over a cached prefix: prefix and chunk passes merged
])
def test_float32_queries_over_a_bfloat16_cache(path, reqs, d, block_size):
    """dtype="bfloat16" on the CPU: float32 q/k/v, a bfloat16 cache. Every path attends the keys and values as
    the cache holds them (rounded once to bfloat16), fresh rows included, in float32 arithmetic."""
    q, k, v, cache, meta, full_k, full_v = make_case(reqs, 9, 3, d, block_size, torch.float32, seed=len(reqs))
    stale = 1e4 * torch.randn(cache.shape, generator=torch.Generator().manual_seed(5))
    cache = torch.where(cache.isnan(), stale, cache).to(torch.bfloat16)
    scale = d ** -0.5
    out = CpuSdpaBackend().forward(q, k, v, cache, meta, scale)
    assert out.dtype == torch.float32 and not out.isnan().any()
    for i, (_, new) in enumerate(reqs):
        lo = meta.query_start_loc_cpu[i]
        rounded_k, rounded_v = (t.to(torch.bfloat16).float() for t in (full_k[i], full_v[i]))
        ref = dense_causal_attention(q[lo:lo + new], rounded_k, rounded_v, scale)
        torch.testing.assert_close(out[lo:lo + new], ref, atol=2e-5, rtol=0, msg=f"request {i}")
    # the new rows went into the cache rounded: a decode row of request 0 reads back what it wrote
    slots = meta.slot_mapping[: meta.num_tokens].long()
    flat = cache.view(2, -1, 3, d)
    assert torch.equal(flat[0, slots[slots >= 0]], k[slots >= 0].to(torch.bfloat16))


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("reqs", [[(40, 30)], [(33, 17), (0, 1), (7, 64)], [(1, 20), (100, 1)]])
def test_long_chunks_over_a_cached_prefix(path, hq, hkv, reqs):
    """More than KERNEL_MAX_ROWS new rows after a cached prefix (a chat turn after a cached system prompt): the
    kernel path attends the prefix and the chunk in two fused passes merged by log-sum-exp."""
    assert any(new > cpu_sdpa.KERNEL_MAX_ROWS and cached for cached, new in reqs)
    check(reqs, hq, hkv, 64, block_size=16, seed=hq + len(reqs), num_padding=1)


def test_rows_past_the_packed_key_limit(path):
    """A chunk whose keys pass the AVX2 path's packed-key limit (4,096: it then runs flash-style, 8 rows at a time)
    and one just within it; every path agrees with the dense reference."""
    check([(4100, 11), (4070, 16)], 9, 3, 64, block_size=16, seed=13)


def test_bounded_pieces(monkeypatch):
    """The gather + SDPA path (the kernel's paths never build score matrices this big) splits a chunk over a cached
    prefix by query rows and a batch of decode rows by requests, to keep each SDPA call under _MAX_SCORE_ELEMS
    score elements; same results."""
    monkeypatch.setattr(cpu_sdpa, "_use_kernel", lambda q, kv: False)
    monkeypatch.setattr(cpu_sdpa, "_MAX_SCORE_ELEMS", 300)
    calls = {"sdpa": 0, "decode": 0}

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    def decode_rows(q, *args):
        calls["decode"] += 1
        assert q.shape[0] == 1  # 300 elements hold less than one decode row's scores and K/V: one request each
        return attend_decode_rows(q, *args)

    attend_decode_rows = cpu_sdpa._attend_decode_rows
    monkeypatch.setattr(cpu_sdpa, "F", types.SimpleNamespace(scaled_dot_product_attention=sdpa))
    monkeypatch.setattr(cpu_sdpa, "_attend_decode_rows", decode_rows)
    check([(10, 21), (0, 1), (30, 1), (7, 1), (0, 17)], 4, 2, 32, 4, seed=9)
    # (10, 21): 300 // (4 heads x 31 keys) = 2 rows per piece, 11 pieces; (0, 17) has no prefix: one causal call;
    # the three decode rows one at a time
    assert calls == {"sdpa": 11 + 1 + 3, "decode": 3}


def test_nan_rows_are_not_written_into_the_cache(route):
    """A NaN / inf K/V row is stored as 0, so a later owner of the block never reads NaN past its length."""
    q, k, v, cache, meta, _, _ = make_case([(0, 5), (3, 1)], 4, 2, 32, 4, seed=4)
    cache.zero_()
    k[1, 0, 0], v[2, 1, 3], k[5, 1, 1] = float("nan"), float("inf"), float("-inf")
    CpuSdpaBackend().forward(q, k, v, cache, meta, 32 ** -0.5)
    assert torch.isfinite(cache).all()


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4), (6, 1), (10, 2)])
@pytest.mark.parametrize("reqs", [[(37, 1)], [(37, 1), (5, 1)], [(0, 1)], [(200, 1), (3, 2)]])
def test_one_or_two_decoding_sequences(path, hq, hkv, reqs):
    """Fewer requests than threads: the kernel splits them by KV head group (and one-row items of head_dim 64
    take the register path); the same answer as the dense reference."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check(reqs, hq, hkv, 64, block_size=16, seed=hq * 7 + len(reqs), num_padding=1)
        check(reqs, hq, hkv, 32, block_size=4, seed=hq * 5 + len(reqs))
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (4, 4)])
def test_a_decode_row_is_the_same_alone_or_in_a_batch(kernel_path, hq, hkv):
    """A decoding sequence's row comes out bit for bit the same whether it runs alone (its work split by KV head
    group over the threads) or among other requests (all its heads in one item), over a context long enough to
    cross the kernel's pieces of copied keys (64) with a tail past a multiple of 8 keys."""
    reqs = [(200, 1), (37, 1), (0, 9), (90, 1), (5, 1)]
    q, k, v, cache, meta, _, _ = make_case(reqs, hq, hkv, 64, 16, seed=hq + hkv)
    cache.nan_to_num_(0.0)
    op, lens = torch.ops.tallyserve_cpu.paged_attention, torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    qsl = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
    tables = meta.block_tables.to(torch.int32).contiguous()
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = op(q.contiguous(), cache, tables, qsl, lens, 0.125)
        alone = op(q[:1].contiguous(), cache, tables[:1].contiguous(), qsl[:2], lens[:1], 0.125)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(alone[0], batch[0])


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 32), (4, 4, 64)])
def test_kernel_reads_q_rows_inside_the_fused_qkv_and_writes_every_row(kernel_path, hq, hkv, d):
    """q sliced out of the fused q/k/v output (strided rows) gives the same output as a contiguous copy, for
    decode rows (the one-row kernel at head_dim 64) and multi-row items alike; rows outside every request
    come back zero, although the output is not zero-filled first."""
    reqs = [(0, 7), (5, 1), (30, 1), (9, 12), (16, 1)]
    q, k, v, cache, meta, _, _ = make_case(reqs, hq, hkv, d, 4, seed=d + hq, num_padding=3)
    cache.copy_(torch.where(cache.isnan(), torch.zeros_like(cache), cache))
    torch.ops.tallyserve_cpu.write_kv_cache_(k, v, cache, meta.slot_mapping)  # this step's rows, as the backend does
    rows = q.shape[0]
    wide = torch.full((rows, (hq + 2 * hkv) * d), float("nan"))
    wide[:, : hq * d] = q.reshape(rows, hq * d)
    strided = wide[:, : hq * d].view(rows, hq, d)
    assert not strided.is_contiguous()
    tables = meta.block_tables.to(torch.int32)
    qsl = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
    lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    op = torch.ops.tallyserve_cpu.paged_attention
    for _ in range(3):  # fresh allocations: no row may keep what the allocator handed over
        want = op(q.contiguous(), cache, tables, qsl, lens, d ** -0.5)
        got = op(strided, cache, tables, qsl, lens, d ** -0.5)
        assert torch.equal(got, want)
        assert (got[meta.num_tokens:] == 0).all() and not got.isnan().any()


@RAW_THROW
def test_kernel_refuses_q_whose_heads_are_not_contiguous():
    """The kernel's own check; its Python callers hand it q through _heads_contiguous (a copy where needed)."""
    q, k, v, cache, meta, _, _ = make_case([(5, 1), (0, 3)], 4, 2, 64, 4, seed=2)
    tables = meta.block_tables.to(torch.int32)
    qsl = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
    lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    bad_q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        torch.ops.tallyserve_cpu.paged_attention(bad_q, cache, tables, qsl, lens, 0.1)
    assert cpu_sdpa._heads_contiguous(bad_q).is_contiguous()


def test_kernel_takes_one_row_whose_row_stride_is_arbitrary(kernel_path):
    """A (1, Hq, D) q counts as contiguous in PyTorch whatever its row stride (size-1 dimension): the kernel
    takes it as it is."""
    q, k, v, cache, meta, _, _ = make_case([(20, 1)], 9, 3, 64, 4, seed=3)
    cache.copy_(torch.where(cache.isnan(), torch.zeros_like(cache), cache))
    torch.ops.tallyserve_cpu.write_kv_cache_(k, v, cache, meta.slot_mapping)
    odd = q.reshape(-1).clone().as_strided((1, 9, 64), (1, 64, 1))
    assert odd.is_contiguous() and odd.stride(0) == 1
    args = (cache, meta.block_tables.to(torch.int32), torch.tensor(meta.query_start_loc_cpu),
            torch.tensor(meta.seq_lens_cpu), 0.125)
    assert torch.equal(torch.ops.tallyserve_cpu.paged_attention(cpu_sdpa._heads_contiguous(odd), *args),
                       torch.ops.tallyserve_cpu.paged_attention(q.contiguous(), *args))


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("reqs,block_size", [
    ([(0, 40)], 16),  # a whole prompt: items of 16 rows, the last one partial
    ([(0, 300), (0, 1), (17, 33)], 16),  # more keys than one 256-key piece; a decode row; a chunk over a prefix
    ([(251, 9), (5, 1), (0, 2)], 4),  # 9 rows whose keys cross the piece boundary; two rows (speculative)
    ([(0, 17), (3, 21)], 1),  # key counts that are not multiples of 8, one-slot blocks
])
def test_chunks_read_the_cache_in_place_on_the_flash_rows_path(flash_rows_path, hq, hkv, reqs, block_size,
                                                               monkeypatch):
    """With the kernel's flash path (head_dim 64, AVX-512 or AVX2), fresh prompts and long chunks whose keys fit
    FAST_ROWS_MAX_KEYS attend in place in one kernel call (no gathered copies, no SDPA): the dense reference's
    answer, float32 and bfloat16 caches."""
    assert torch.ops.tallyserve_cpu.has_fast_rows()
    called = []
    monkeypatch.setattr(cpu_sdpa, "_causal_flash", lambda *a: called.append("sdpa"))
    monkeypatch.setattr(cpu_sdpa, "_attend_prefix_and_chunk", lambda *a: called.append("prefix"))
    check(reqs, hq, hkv, 64, block_size, seed=hq + block_size, num_padding=2)
    assert cpu_sdpa._last_plan[2].all_paged and not called
    check(reqs, hq, hkv, 64, block_size, dtype=torch.bfloat16, atol=2e-2, seed=hq + 2 * block_size)


@pytest.mark.parametrize("reqs", [[(0, 40), (3, 1)], [(30, 40), (5, 1)], [(0, 24)]])
def test_chunks_past_the_key_limit_take_the_fused_sdpa(kernel_path, reqs, monkeypatch):
    """Chunks whose last row sees more than FAST_ROWS_MAX_KEYS keys (long prompts, where PyTorch's SDPA is
    faster) keep the fused SDPA passes: a fresh prompt, and a chunk over a cached prefix."""
    monkeypatch.setattr(cpu_sdpa, "FAST_ROWS_MAX_KEYS", 20)
    cpu_sdpa._last_plan[:] = [None, None, None]
    check(reqs, 9, 3, 64, 16, seed=len(reqs), num_padding=1)
    plan = cpu_sdpa._last_plan[2]
    assert len(plan.fresh) + len(plan.long) == 1 and not plan.all_paged
