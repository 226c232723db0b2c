"""The CPU kernel's AMX path for chunks over a bfloat16 cache (dtype="bfloat16" on the CPU): the same answer as the
float32 path to float32 rounding, on every shape of chunk, prefix, head group and block size, and no harm to
PyTorch's own AMX kernels running in the same threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tallyserve.kernels import cpu_kernels
from tests.unit.test_attention_ref import make_case

OPS = torch.ops.tallyserve_cpu if cpu_kernels.load() else None
AMX = OPS is not None and OPS.amx_usable()
pytestmark = pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU (or the kernels could not be built)")


# (query heads, KV heads) and (requests as (cached, new) tokens, block size): shared with test_attention_amx_emulated
HEADS = [(9, 3), (4, 4), (8, 2), (6, 1), (12, 3)]
CASES = [
    ([(0, 40)], 16),  # one prompt: three row tiles, the last partial
    ([(0, 150), (0, 1), (17, 33)], 16),  # an item of 64 rows and a second one; a decode row; a chunk over a prefix
    ([(200, 9), (5, 3), (0, 2)], 4),  # keys across several 64-key pieces; speculative rows
    ([(0, 17), (3, 21)], 1),  # one-slot blocks: no two keys of a tile share a block
    ([(70, 66)], 32),  # rows past one item, keys past one piece, both unaligned
]


def _attend(q, cache, meta, amx: bool) -> torch.Tensor:
    OPS.set_amx(amx)
    try:
        return OPS.paged_attention(q, cache, meta.block_tables.to(torch.int32), meta.query_start_loc.to(torch.long),
                                   meta.seq_lens.to(torch.long), q.shape[2] ** -0.5)
    finally:
        OPS.set_amx(True)


def _dense_reference(q, full_k, full_v, reqs, meta, dtype=torch.float64) -> torch.Tensor:
    """Dense causal attention over the cache's bfloat16 K/V, computed in ``dtype`` (float64: the reference;
    float32: what the float32 path computes, to rounding)."""
    out = torch.zeros(q.shape, dtype=dtype)
    for i, (cached, new) in enumerate(reqs):
        lo = meta.query_start_loc_cpu[i]
        k = full_k[i].to(dtype).repeat_interleave(q.shape[1] // full_k[i].shape[1], dim=1)
        v = full_v[i].to(dtype).repeat_interleave(q.shape[1] // full_v[i].shape[1], dim=1)
        s = torch.einsum("qhd,khd->hqk", q[lo:lo + new].to(dtype), k) * q.shape[2] ** -0.5
        pos = torch.arange(cached, cached + new)[:, None]
        s = s.masked_fill(torch.arange(cached + new)[None, :] > pos, float("-inf"))
        out[lo:lo + new] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out


def _case(reqs, hq, hkv, block_size, seed, q_scale=1.0):
    q, k, v, cache, meta, full_k, full_v = make_case(reqs, hq, hkv, 64, block_size, torch.bfloat16, seed)
    cache = torch.nan_to_num(cache, nan=0.0)
    flat = cache.view(2, -1, hkv, 64)
    flat[0, meta.slot_mapping] = k  # the new rows too: the kernel reads every key from the cache
    flat[1, meta.slot_mapping] = v
    gen = torch.Generator().manual_seed(seed + 1)
    q32 = torch.randn(q.shape, generator=gen) * q_scale  # float32 queries, as the bfloat16 mode has them
    return q32, cache, meta, full_k, full_v


def _check(reqs, hq, hkv, block_size, seed, q_scale=1.0):
    q, cache, meta, full_k, full_v = _case(reqs, hq, hkv, block_size, seed, q_scale)
    amx, f32 = _attend(q, cache, meta, True), _attend(q, cache, meta, False)
    ref = _dense_reference(q, full_k, full_v, reqs, meta)
    err_amx, err_f32 = (amx.double() - ref).abs().max().item(), (f32.double() - ref).abs().max().item()
    # float32 rounding on both paths: the AMX path's products are exact, only the order of the sums differs
    assert err_amx <= 2 * err_f32 + 1e-6, (err_amx, err_f32)
    torch.testing.assert_close(amx, f32, atol=1e-5, rtol=1e-5)
    return amx


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("reqs,block_size", CASES)
def test_amx_path_equals_the_float32_path(hq, hkv, reqs, block_size):
    _check(reqs, hq, hkv, block_size, seed=hq * 7 + block_size)


def test_queries_of_wide_range_keep_float32_precision():
    """Scores of 100-odd (peaked softmax) and queries of mixed magnitudes: three bfloat16 parts carry all of
    float32's bits, where one part would miss by far more than the tolerance."""
    q, cache, meta, full_k, full_v = _case([(30, 50)], 9, 3, 16, seed=5, q_scale=30.0)
    q[:, :, ::2] *= 1e-3
    amx, f32 = _attend(q, cache, meta, True), _attend(q, cache, meta, False)
    ref = _dense_reference(q, full_k, full_v, [(30, 50)], meta)
    assert (amx.double() - ref).abs().max() <= 2 * (f32.double() - ref).abs().max() + 1e-6
    # what a single bfloat16 rounding of q would give: visibly worse, so the test can tell
    rounded = _attend(q.to(torch.bfloat16).float(), cache, meta, False)
    assert (rounded.double() - ref).abs().max() > 10 * (amx.double() - ref).abs().max()


@settings(max_examples=25, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(0, 140), st.integers(1, 90)), min_size=1, max_size=4),
       heads=st.sampled_from([(9, 3), (8, 2), (4, 1), (2, 2)]), block_size=st.sampled_from([1, 8, 16]),
       seed=st.integers(0, 1000))
def test_random_chunks_match_the_float32_path(reqs, heads, block_size, seed):
    _check(reqs, heads[0], heads[1], block_size, seed)


def test_turning_it_off_and_on():
    assert OPS.set_amx(False) is False and OPS.amx_usable() is False
    assert OPS.set_amx(True) is True and OPS.amx_usable() is True


def test_pytorch_amx_kernels_unharmed_in_the_same_threads():
    """The kernel saves the thread's tile configuration and puts it back: PyTorch's bfloat16 attention and matmul
    (oneDNN / brgemm on AMX) give the same results before and after it runs."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, 256, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(300, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(70, 200, generator=gen).to(torch.bfloat16)

    def torch_side():
        return F.scaled_dot_product_attention(a, a, a, is_causal=True), F.linear(x, w)

    before = torch_side()
    q, cache, meta, _, _ = _case([(0, 100), (20, 40)], 9, 3, 16, seed=3)
    for _ in range(3):
        first = _attend(q, cache, meta, True)
        after = torch_side()
        assert all(torch.equal(b, c) for b, c in zip(before, after))
    assert torch.equal(_attend(q, cache, meta, True), first)
