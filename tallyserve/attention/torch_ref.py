"""Torch reference paged attention: plain tensor ops, runs on CPU and GPU, computes in float32.

It is the ground truth the Triton kernels are tested against, so clarity beats speed: requests
with more than one query row (prefill chunks) are handled one at a time; single-row requests
(decode) are batched together. Work is split into pieces of bounded size so a long prompt does
not materialise a (heads x T x T) score matrix at once.
"""

from __future__ import annotations

import torch

from tallyserve.attention.backend import FP8_KV_DTYPE, AttentionBackend, KVScale, check_attention_inputs
from tallyserve.attention.metadata import AttentionMetadata

# Upper bound on float32 elements of one score / gathered-context piece (2**26 * 4 B = 256 MiB).
_MAX_PIECE_ELEMS = 1 << 26


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V rows as a cache of ``dtype`` stores them: an FP8 cache holds x / scale rounded to e4m3 (saturated at
    +-448), any other the rounded x."""
    if dtype == FP8_KV_DTYPE:
        return (x.float() / scale).clamp_(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def from_cache(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached K or V rows in float32 (an FP8 cache's times its scale)."""
    out = x.float()
    return out.mul_(scale) if x.dtype == FP8_KV_DTYPE and scale != 1.0 else out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scale: KVScale = (1.0, 1.0)) -> None:
    """Scatter k/v rows (T, Hkv, D) into the cache at their flat slots; rows with slot < 0 are skipped."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    slots = slots[valid]
    k, v = to_cache(k[valid], kv_cache.dtype, kv_scale[0]), to_cache(v[valid], kv_cache.dtype, kv_scale[1])
    if kv_cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no FP8 kernel: copy the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def _context_slots(block_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [0, length) of one request, through its block table row."""
    pos = torch.arange(length, device=block_row.device)
    blocks = block_row[pos // block_size].to(torch.long)
    return blocks * block_size + pos % block_size


def _attend_one_request(
    q: torch.Tensor, flat_kv: torch.Tensor, block_row: torch.Tensor, seq_len: int, block_size: int, scale: float,
    kv_scale: KVScale = (1.0, 1.0),
) -> torch.Tensor:
    """Causal attention of one request's query rows q (Lq, Hq, D), which sit at positions
    [seq_len - Lq, seq_len), over its cached context. Returns float32 (Lq, Hq, D)."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads = flat_kv.shape[2]
    group = num_q_heads // num_kv_heads
    first_pos = seq_len - num_q
    out = torch.empty((num_q, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    chunk = max(1, _MAX_PIECE_ELEMS // max(1, num_q_heads * seq_len))
    for start in range(0, num_q, chunk):
        end = min(num_q, start + chunk)
        ctx_len = first_pos + end  # the last query of this piece sees keys [0, first_pos + end)
        slots = _context_slots(block_row, ctx_len, block_size)
        keys = from_cache(flat_kv[0, slots], kv_scale[0]).permute(1, 0, 2)  # (Hkv, L, D)
        values = from_cache(flat_kv[1, slots], kv_scale[1]).permute(1, 0, 2)
        qs = q[start:end].float().view(end - start, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,hkd->hgqk", qs, keys) * scale
        q_pos = torch.arange(first_pos + start, first_pos + end, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (Lq_piece, L)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        res = torch.einsum("hgqk,hkd->hgqd", probs, values)  # (Hkv, G, Lq_piece, D)
        out[start:end] = res.permute(2, 0, 1, 3).reshape(end - start, num_q_heads, head_dim)
    return out


def _attend_decode_rows(
    q: torch.Tensor, flat_kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
    block_size: int, scale: float, kv_scale: KVScale = (1.0, 1.0),
) -> torch.Tensor:
    """Attention of B single-row requests together: q (B, Hq, D), each request's only query is its
    last position, so it sees its whole context. block_tables (B, max_blocks). Returns float32."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = flat_kv.shape[2]
    group = num_q_heads // num_kv_heads
    lens = torch.tensor(seq_lens, device=q.device)
    pos = torch.arange(max(seq_lens), device=q.device)
    valid = pos[None, :] < lens[:, None]  # (B, Lmax)
    # Positions past a request's length re-read its last position, so no unwritten slot is touched
    # (uninitialised memory may hold NaN, and 0 * NaN would leak through the softmax).
    pos_read = torch.minimum(pos[None, :], lens[:, None] - 1)
    blocks = torch.gather(block_tables.to(torch.long), 1, pos_read // block_size)
    slots = blocks * block_size + pos_read % block_size  # (B, Lmax)
    keys = from_cache(flat_kv[0][slots], kv_scale[0])  # (B, Lmax, Hkv, D)
    values = from_cache(flat_kv[1][slots], kv_scale[1])
    qs = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qs, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    res = torch.einsum("bhgk,bkhd->bhgd", probs, values)
    return res.reshape(batch, num_q_heads, head_dim)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of every query row over its request's cached context (already written).
    Returns (T, Hq, D) in q's dtype; trailing padding rows (past query_start_loc[-1]) stay zero."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat_kv = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    out = torch.zeros_like(q)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
    for i in range(meta.num_reqs):
        lo, hi = starts[i], starts[i + 1]
        if hi - lo > seq_lens[i]:
            raise ValueError(f"request {i} has {hi - lo} query rows but seq_len {seq_lens[i]}")
        if hi - lo > 1:
            res = _attend_one_request(q[lo:hi], flat_kv, meta.block_tables[i], seq_lens[i], block_size, scale,
                                      kv_scale)
            out[lo:hi] = res.to(q.dtype)
    if decode:
        widest = max(q.shape[1], kv_cache.shape[3] * kv_cache.shape[4])  # scores vs gathered K per position
        per_req = widest * max(seq_lens[i] for i in decode)
        step = max(1, _MAX_PIECE_ELEMS // max(1, per_req))
        for p in range(0, len(decode), step):
            group = decode[p:p + step]
            idx = torch.tensor(group, device=q.device)
            rows = torch.tensor([starts[i] for i in group], device=q.device)
            res = _attend_decode_rows(
                q[rows], flat_kv, meta.block_tables[idx], [seq_lens[i] for i in group], block_size, scale, kv_scale
            )
            out[rows] = res.to(q.dtype)
    return out


class TorchRefBackend(AttentionBackend):
    """Reference backend: write the new K/V, then ``paged_attention``."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = (1.0, 1.0),
    ) -> torch.Tensor:
        check_attention_inputs(q, k, v, kv_cache, meta)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return paged_attention(q, kv_cache, meta, scale, kv_scale)
