"""The torch reference paged attention against a naive dense causal attention."""

from __future__ import annotations

import random

import pytest
import torch

import tallyserve.attention.torch_ref as torch_ref
from tallyserve.attention.backend import get_attn_backend, get_kv_cache_shape
from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.attention.torch_ref import TorchRefBackend


def dense_causal_attention(q, k, v, scale):
    """q (Lq, Hq, D) at the last Lq positions of k/v (L, Hkv, D); float32 result."""
    num_q, num_q_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def make_case(reqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0, num_padding=0):
    """reqs: [(cached_len, query_len)]. Cached positions are pre-written into a NaN-filled cache
    through shuffled block tables; returns everything needed to run and check one step."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in reqs)
    num_blocks = blocks_needed + 3
    cache = torch.full(get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    full_k, full_v, tables, slots, starts, q_rows = [], [], [], [], [0], []
    for cached, new in reqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        req_slots = [table[p // block_size] * block_size + p % block_size for p in range(total)]
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat = cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, req_slots[:cached]] = k[:cached]
        flat[1, req_slots[:cached]] = v[:cached]
        full_k.append(k)
        full_v.append(v)
        slots += req_slots[cached:]
        starts.append(starts[-1] + new)
        q_rows.append(torch.randn(new, num_q_heads, head_dim, generator=gen).to(dtype))
    width = max(len(t) for t in tables)

    def padding(heads: int) -> torch.Tensor:
        return torch.zeros(num_padding, heads, head_dim, dtype=dtype)

    q = torch.cat(q_rows + [padding(num_q_heads)])
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, reqs)] + [padding(num_kv_heads)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, reqs)] + [padding(num_kv_heads)])
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(seq_lens),
    )
    return q, k_new, v_new, cache, meta, full_k, full_v


def check_against_dense(reqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, atol=1e-5,
                        seed=0, num_padding=0):
    q, k, v, cache, meta, full_k, full_v = make_case(
        reqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed, num_padding
    )
    scale = head_dim ** -0.5
    out = TorchRefBackend().forward(q, k, v, cache, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    for i, (_, new) in enumerate(reqs):
        lo = meta.query_start_loc_cpu[i]
        ref = dense_causal_attention(q[lo:lo + new], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[lo:lo + new].float(), ref, atol=atol, rtol=0, msg=f"request {i}")
    if num_padding:
        assert (out[meta.num_tokens:] == 0).all()
    return cache, meta


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_mixed_prefill_and_decode(head_dim, num_q_heads, num_kv_heads):
    reqs = [(0, 7), (5, 1), (0, 1), (9, 6), (16, 1), (3, 13)]  # fresh prefill, decodes, chunked prefills
    check_against_dense(reqs, num_q_heads, num_kv_heads, head_dim, block_size=4, seed=head_dim + num_q_heads)


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts(seed):
    rng = random.Random(seed)
    num_reqs = rng.randint(1, 6)
    reqs = [(rng.choice([0, rng.randint(1, 40)]), rng.choice([1, rng.randint(1, 20)])) for _ in range(num_reqs)]
    block_size = rng.choice([1, 3, 16])
    check_against_dense(reqs, 8, 2, 64, block_size, seed=seed, num_padding=rng.randint(0, 3))


def test_bfloat16_inputs_computed_in_float32():
    check_against_dense([(4, 9), (11, 1)], 4, 2, 64, block_size=8, dtype=torch.bfloat16, atol=2e-2)


def test_small_pieces_match(monkeypatch):
    """Long queries split into several score pieces, decodes split into several groups."""
    monkeypatch.setattr(torch_ref, "_MAX_PIECE_ELEMS", 200)
    check_against_dense([(0, 23), (7, 1), (30, 1), (2, 1), (5, 11)], 4, 2, 64, block_size=4)


def test_padding_rows_are_not_written():
    reqs = [(3, 4), (6, 1)]
    q, k, v, cache, meta, _, _ = make_case(reqs, 4, 2, 64, 4, num_padding=5)
    before = cache.clone()
    TorchRefBackend().forward(q, k, v, cache, meta, 0.125)
    changed = ~(torch.isnan(before) & torch.isnan(cache)) & (before != cache)  # NaN != NaN, so compare carefully
    changed_slots = changed.view(2, -1, 2 * 64).any(-1).any(0).nonzero().flatten().tolist()
    assert sorted(changed_slots) == sorted(meta.slot_mapping[meta.slot_mapping >= 0].tolist())
    # the cache holds exactly the new rows at their slots
    flat = cache.view(2, -1, 2, 64)
    real = meta.slot_mapping[: meta.num_tokens]
    torch.testing.assert_close(flat[0, real], k[: meta.num_tokens])
    torch.testing.assert_close(flat[1, real], v[: meta.num_tokens])


def test_shape_errors():
    q, k, v, cache, meta, _, _ = make_case([(0, 3)], 4, 2, 64, 4)
    backend = get_attn_backend("torch")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        backend.forward(q[:, :3], k, v, cache, meta, 1.0)
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.forward(q, k, v, cache[:, :, :, :1], meta, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.forward(q[:2], k[:2], v[:2], cache, meta, 1.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("flashinfer")
    with pytest.raises(ValueError, match="block_size"):
        get_kv_cache_shape(4, 0, 2, 64)
