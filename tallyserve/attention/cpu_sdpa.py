"""CPU paged attention. With the compiled kernel (`csrc/paged_attention_cpu.cpp`, float32 queries over a float32
cache, or a bfloat16 one under dtype="bfloat16"): decode rows, short chunks and, on AVX-512 builds at head_dim 64,
every chunk whose last row sees at most FAST_ROWS_MAX_KEYS keys read K/V in place from the paged cache (the
kernel's flash path for chunks); a longer chunk that is its request's whole context attends its own fresh K/V
with the fused causal SDPA (rounded to the cache's dtype first, so it attends what later rows read), and a longer
chunk over a cached prefix takes two fused SDPA passes. Without the kernel (no compiler, half-precision queries):
whole KV blocks gathered with one `index_select` per request (or per batch of decode rows) and PyTorch's fused
`scaled_dot_product_attention` (grouped-query heads without
repeating K/V), instead of the reference's per-position gathers and einsums, which spend most of
their time in index and copy kernels. Computes in float32 like the reference (`torch_ref.py`), which
the tests compare it with; the default backend on the CPU.

Positions past a request's length inside its gathered blocks (the last block's tail, the shorter
requests of a decode batch, padded block-table entries) are masked out of the scores. Masking is
exact only if what those slots hold is finite (0 * NaN is NaN), so this backend keeps the cache finite:
the runner zero-fills it, and every K/V row written here has NaN / inf replaced by 0 (a row with NaN
is garbage already; this keeps it from poisoning another request that later reuses its block).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tallyserve.kernels import cpu_kernels
from tallyserve.attention.backend import AttentionBackend, KVScale, check_attention_inputs
from tallyserve.attention.metadata import AttentionMetadata, OutputRows
from tallyserve.attention.torch_ref import from_cache, write_kv_cache

# Upper bound on float32 score elements of one SDPA call's masked path (2**26 * 4 B = 256 MiB).
_MAX_SCORE_ELEMS = 1 << 26


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
            kv_scale: KVScale = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, length) of one request: (Hkv, length, D) float32 views of one copy."""
    bs, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    nb = -(-length // bs)
    ids = block_ids[:nb].to(torch.long)
    k = from_cache(kv_cache[0].index_select(0, ids).view(nb * bs, hkv, d)[:length], kv_scale[0])
    v = from_cache(kv_cache[1].index_select(0, ids).view(nb * bs, hkv, d)[:length], kv_scale[1])
    return k.transpose(0, 1), v.transpose(0, 1)


def _attend_request(q: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                    scale: float, kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
    """Causal attention of one request's query rows q (Lq, Hq, D) at positions [seq_len - Lq,
    seq_len) over its context. Returns float32 (Lq, Hq, D)."""
    num_q, num_heads, _ = q.shape
    k, v = _gather(kv_cache, block_row, seq_len, kv_scale)
    qs = q.float().transpose(0, 1)  # (Hq, Lq, D)
    if num_q == seq_len:  # nothing cached before this chunk: plain causal attention
        out = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    first = seq_len - num_q
    out = torch.empty((num_heads, num_q, q.shape[2]), dtype=torch.float32)
    piece = max(1, _MAX_SCORE_ELEMS // max(1, num_heads * seq_len))
    k_pos = torch.arange(seq_len)
    for start in range(0, num_q, piece):
        end = min(num_q, start + piece)
        allowed = k_pos[None, :] <= torch.arange(first + start, first + end)[:, None]  # (rows, L)
        out[:, start:end] = F.scaled_dot_product_attention(qs[:, start:end], k, v, attn_mask=allowed, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(0, 1)


def _attend_decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                        scale: float, kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
    """Single-row requests together: q (B, Hq, D), each over its whole context. Returns float32."""
    batch, num_heads, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    nb = -(-max(seq_lens) // bs)
    ids = block_tables[:, :nb].reshape(-1).to(torch.long)
    k = from_cache(kv_cache[0].index_select(0, ids).view(batch, nb * bs, hkv, d), kv_scale[0])
    v = from_cache(kv_cache[1].index_select(0, ids).view(batch, nb * bs, hkv, d), kv_scale[1])
    valid = torch.arange(nb * bs)[None, :] < torch.tensor(seq_lens)[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(q.float().view(batch, num_heads, 1, d), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=valid[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out.view(batch, num_heads, d)


# Query rows of one request up to which the in-place kernel beats gathering the context for the blocked SDPA
# (decode rows, speculative verification, short chunks); measured on a 2-core AVX-512 machine.
KERNEL_MAX_ROWS = 16
# With the kernel's flash path for chunks (head_dim 64, AVX-512), chunks whose last row sees at most this many keys
# read K/V in place too: a fresh chunk skips the rounded copies of its K/V, the repeated K/V heads and the SDPA call.
# Measured on a 2-core AVX-512 machine, bf16 cache: W's prompts (32-512 tokens) -25%, a 1,030-token prompt -10 to
# -17%, 2,048 tokens even; at 4,000 PyTorch's SDPA is 5-10% faster.
FAST_ROWS_MAX_KEYS = 2048


def _causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk over itself, (L, H, D) in and out, on PyTorch's fused CPU kernel: it takes
    4-D inputs with as many K/V heads as query heads (grouped-query or 3-D inputs fall back to the unfused
    math path, about 5x slower at 512 tokens), so K/V heads are repeated for their query groups."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's fused CPU attention with its log-sum-exp: q (Hq, Lq, D), k/v (Hq, Lk, D) float32 ->
    out (Hq, Lq, D), lse (Hq, Lq)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], 0.0, causal,
                                                                         scale=scale)
    return out[0], lse[0]


def _attend_prefix_and_chunk(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                             block_row: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """A long chunk (Lq rows at positions [seq_len - Lq, seq_len)) over a cached prefix, in two fused passes
    merged by their log-sum-exps: every row over the whole prefix (no mask), and the chunk over its own fresh
    K/V (causal). The single masked SDPA it replaces ran on PyTorch's unfused path: a chat turn of 1,000 tokens
    after a cached system prompt took twice the time of the same prompt uncached."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k_new.shape[1]
    k_pre, v_pre = _gather(kv_cache, block_row, seq_len - num_q)  # (Hkv, P, D)
    qs = q.float().transpose(0, 1).contiguous()  # (Hq, Lq, D)
    expand = (lambda t: t.repeat_interleave(group, dim=0)) if group > 1 else (lambda t: t)
    out_pre, lse_pre = _flash_with_lse(qs, expand(k_pre), expand(v_pre), False, scale)
    out_new, lse_new = _flash_with_lse(qs, expand(k_new.transpose(0, 1)), expand(v_new.transpose(0, 1)), True, scale)
    top = torch.maximum(lse_pre, lse_new)
    w_pre, w_new = (lse_pre - top).exp_()[..., None], (lse_new - top).exp_()[..., None]
    out = (out_pre * w_pre + out_new * w_new) / (w_pre + w_new)
    return out.transpose(0, 1)


def _use_kernel(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The compiled path: float32 queries over a contiguous float32 or bfloat16 cache (dtype="bfloat16" on the CPU)."""
    return (q.dtype == torch.float32 and kv_cache.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
            and cpu_kernels.load())


class _KernelPlan:
    """How one forward pass's requests split over the paths of `paged_attention_kernel`, and the kernel's
    arguments; built once per pass (per metadata object) and shared by every layer. ``validate`` checks the
    arguments against a cache before the kernel sees them (once per pass and cache shape)."""

    def __init__(self, meta: AttentionMetadata, has_fresh_kv: bool, fast_rows: bool) -> None:
        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        self.fast_rows = fast_rows
        self.fresh: list[tuple[int, int]] = []
        self.long: list[tuple[int, int, int]] = []
        paged: list[int] = []
        for i in range(meta.num_reqs):
            lo, hi = starts[i], starts[i + 1]
            if not 0 <= hi - lo <= seq_lens[i]:
                raise ValueError(f"request {i} has {hi - lo} query rows but seq_len {seq_lens[i]}")
            if hi - lo <= KERNEL_MAX_ROWS or (fast_rows and seq_lens[i] <= FAST_ROWS_MAX_KEYS):
                if hi > lo:
                    paged.append(i)
            elif hi - lo == seq_lens[i] and has_fresh_kv:
                self.fresh.append((lo, hi))
            else:  # a long chunk over a cached prefix: the blocked SDPA wins
                self.long.append((i, lo, hi))
        self.any_paged = bool(paged)
        self.all_paged = len(paged) == meta.num_reqs
        self.valid_for: Optional[tuple[int, int]] = None  # (num_blocks, block_size) of the cache validate() passed
        if starts and starts[0] < 0:
            raise ValueError(f"query_start_loc starts at {starts[0]}")
        tables = meta.block_tables if meta.block_tables.dtype == torch.int32 else meta.block_tables.to(torch.int32)
        self.reqs = paged  # the request of each of the kernel's rows of tables / lens
        self.num_rows = 0  # q rows the kernel reads
        self.max_len = 0  # the longest seq_len among them
        if self.all_paged:
            self.rows = None
            self.qsl = torch.tensor(starts, dtype=torch.long)
            self.tables = tables.contiguous()
            self.lens = torch.tensor(seq_lens, dtype=torch.long)
            self.num_rows = starts[-1] if starts else 0
            self.max_len = max(seq_lens, default=0)
        elif paged:
            self.rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in paged])
            self.qsl = torch.tensor([0] + [starts[i + 1] - starts[i] for i in paged], dtype=torch.long).cumsum(0)
            self.tables = tables[torch.tensor(paged)].contiguous()
            self.lens = torch.tensor([seq_lens[i] for i in paged], dtype=torch.long)
            self.max_len = max(seq_lens[i] for i in paged)

    def validate(self, kv_cache: torch.Tensor, q_rows: int) -> None:
        """ValueError where the kernel's TORCH_CHECKs would refuse this pass over ``kv_cache`` (2, num_blocks,
        block_size, Hkv, D), so that a bad input never reaches them (an exception from the kernel is unsafe on some
        hosts, see cpu_kernels): a block id that a request's seq_len reaches outside [0, num_blocks), a seq_len past
        its block-table row, fewer q rows than the requests cover. Once per pass and cache shape (the layers after
        the first compare two ints): one min/max of the whole table, and only where that finds an id outside the
        cache (a padding entry past a request's length is never read, so it may be anything), the masked check.
        4-15 us per pass when warm (1 to 256 requests); 20-30 us in a decode step of 8 requests of a 30-layer
        model on a busy 2-core machine, where its first reduction comes after the layers' work; 0.4-1 us per later
        layer."""
        key = (kv_cache.shape[1], kv_cache.shape[2])
        if self.valid_for == key:
            return
        if self.all_paged and q_rows < self.num_rows:
            raise ValueError(f"q has {q_rows} rows but the requests cover {self.num_rows}")
        if self.any_paged:
            num_blocks, block_size = key
            width = self.tables.shape[1]
            if self.max_len > width * block_size:
                r = int((self.lens > width * block_size).nonzero()[0, 0])
                raise ValueError(f"request {self.reqs[r]}: seq_len {int(self.lens[r])} is past its block table "
                                 f"({width} blocks of {block_size})")
            lo, hi = cpu_kernels.int_bounds(self.tables) if width else (0, 0)
            if lo < 0 or hi >= num_blocks:
                need = (self.lens + (block_size - 1)).div_(block_size, rounding_mode="floor")  # blocks each one reads
                used = torch.arange(width) < need[:, None]
                bad = used & ((self.tables < 0) | (self.tables >= num_blocks))
                if bad.any():
                    r, b = (int(i) for i in bad.nonzero()[0])
                    raise ValueError(f"request {self.reqs[r]}: block id out of range ({int(self.tables[r, b])} at "
                                     f"block {b}; the cache has {num_blocks} blocks)")
        self.valid_for = key


_last_plan: list = [None, None, None]  # [metadata, has_fresh_kv, plan]: the pass in flight


def _plan_for(meta: AttentionMetadata, has_fresh_kv: bool, fast_rows: bool) -> _KernelPlan:
    if _last_plan[0] is not meta or _last_plan[1] != has_fresh_kv or _last_plan[2].fast_rows != fast_rows:
        _last_plan[:] = [meta, has_fresh_kv, _KernelPlan(meta, has_fresh_kv, fast_rows)]
    return _last_plan[2]


_fast_rows: list[bool] = []


def _has_fast_rows(q: torch.Tensor) -> bool:
    """Whether the kernel's flash path for chunks applies: head_dim 64 and a build with AVX-512."""
    if q.shape[2] != 64:
        return False
    return _has_fast_rows_flag()


def compiled_decode_plan(meta: AttentionMetadata, head_dim: int, kv_dtype: torch.dtype) -> Optional[_KernelPlan]:
    """The kernel plan of a pass whose every request the compiled kernel attends in place (decode rows and short
    chunks over a float32 or bfloat16 cache), for callers that run the layers themselves
    (``models.cpu_layers``); None when some request takes another path or the kernels are off."""
    if kv_dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.load():
        return None
    fast = head_dim == 64 and _has_fast_rows_flag()
    plan = _plan_for(meta, True, fast)
    return plan if plan.all_paged else None


def _has_fast_rows_flag() -> bool:
    if not _fast_rows:
        _fast_rows.append(bool(torch.ops.tallyserve_cpu.has_fast_rows()))
    return _fast_rows[0]


def _heads_contiguous(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel takes it: each row's heads contiguous, rows may be strided (q sliced out of the fused
    q/k/v output needs no copy)."""
    rows, heads, dim = q.shape
    if q.stride(2) == 1 and (heads <= 1 or q.stride(1) == dim) and (rows <= 1 or q.stride(0) >= heads * dim):
        return q
    return q.contiguous()


def paged_attention_kernel(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                           kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The compiled path (float32): decode rows, short chunks and chunks within FAST_ROWS_MAX_KEYS keys (on the
    kernel's flash path) read their context in place from the paged cache in one kernel call, without gathering
    copies; a longer chunk that is its request's whole context attends its own fresh ``k``/``v`` with the fused
    causal SDPA (nothing read back from the cache), and a longer chunk over a cached prefix takes the gather +
    SDPA passes. Padding rows stay zero."""
    plan = _plan_for(meta, k is not None, _has_fast_rows(q))
    plan.validate(kv_cache, q.shape[0])
    if plan.all_paged:  # decode and short chunks only: the kernel's output is the answer (padding rows zero)
        return torch.ops.tallyserve_cpu.paged_attention(_heads_contiguous(q), kv_cache, plan.tables, plan.qsl,
                                                        plan.lens, scale)
    out = torch.empty_like(q)
    out[meta.num_tokens:] = 0  # padding rows; every request's rows are written below
    if (plan.fresh or plan.long) and k is not None and kv_cache.dtype != q.dtype:
        k, v = k.to(kv_cache.dtype).to(q.dtype), v.to(kv_cache.dtype).to(q.dtype)  # a bfloat16 cache's values
    for lo, hi in plan.fresh:  # k, v: as cached (finite)
        out[lo:hi] = _causal_flash(q[lo:hi], k[lo:hi], v[lo:hi], scale)
    for i, lo, hi in plan.long:
        if k is not None:  # the chunk's own K/V at hand: prefix and chunk in two fused passes
            out[lo:hi] = _attend_prefix_and_chunk(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, meta.block_tables[i],
                                                  meta.seq_lens_cpu[i], scale).to(q.dtype)
        else:
            out[lo:hi] = _attend_request(q[lo:hi], kv_cache, meta.block_tables[i], meta.seq_lens_cpu[i],
                                         scale).to(q.dtype)
    if plan.any_paged:
        out[plan.rows] = torch.ops.tallyserve_cpu.paged_attention(q[plan.rows].contiguous(), kv_cache, plan.tables,
                                                                  plan.qsl, plan.lens, scale)
    return out


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
    """As `torch_ref.paged_attention`: (T, Hq, D) in q's dtype, padding rows zero (the PyTorch path; an FP8 cache
    always takes it)."""
    out = torch.zeros_like(q)
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode = []
    for i in range(meta.num_reqs):
        lo, hi = starts[i], starts[i + 1]
        if hi - lo > seq_lens[i]:
            raise ValueError(f"request {i} has {hi - lo} query rows but seq_len {seq_lens[i]}")
        if hi - lo == 1:
            decode.append(i)
        elif hi > lo:
            out[lo:hi] = _attend_request(q[lo:hi], kv_cache, meta.block_tables[i], seq_lens[i], scale,
                                         kv_scale).to(q.dtype)
    if decode:
        widest = q.shape[1] + 2 * kv_cache.shape[3] * kv_cache.shape[4]  # scores and gathered K/V per position
        step = max(1, _MAX_SCORE_ELEMS // max(1, widest * max(seq_lens[i] for i in decode)))
        for p in range(0, len(decode), step):
            group = decode[p:p + step]
            rows = torch.tensor([starts[i] for i in group])
            res = _attend_decode_rows(q[rows], kv_cache, meta.block_tables[torch.tensor(group)],
                                      [seq_lens[i] for i in group], scale, kv_scale)
            out[rows] = res.to(q.dtype)
    return out


class CpuSdpaBackend(AttentionBackend):
    """Write the new K/V, then ``paged_attention_cpu``."""

    name = "cpu_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
        check_attention_inputs(q, k, v, kv_cache, meta)
        k, v = _write_kv(q, k, v, kv_cache, meta.slot_mapping, kv_scale)
        if _use_kernel(q, kv_cache):
            return paged_attention_kernel(q, k, v, kv_cache, meta, scale)
        return paged_attention_cpu(q, kv_cache, meta, scale, kv_scale)

    def forward_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, out: OutputRows,
                     kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
        """Every row's K/V into the cache, then only ``out.rows`` attend, read from the cache (each a decode-like
        row over its request's keys)."""
        check_attention_inputs(q, k, v, kv_cache, meta)
        _write_kv(q, k, v, kv_cache, meta.slot_mapping, kv_scale)
        q = q[out.rows]
        if _use_kernel(q, kv_cache):
            return paged_attention_kernel(q, None, None, kv_cache, out.meta, scale)
        return paged_attention_cpu(q, kv_cache, out.meta, scale, kv_scale)


def _write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scale: KVScale = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v rows to their slots with non-finite values stored as 0 (the cache stays finite, see above); returns k, v
    as cached, which fresh chunks attend."""
    if _use_kernel(q, kv_cache) and k.dtype == v.dtype == torch.float32 and k.stride(2) == v.stride(2) == 1:
        cpu_kernels.check_slots(slot_mapping, k.shape[0], kv_cache)  # ValueError, never the kernel's TORCH_CHECK
        # one pass; it reports whether any value was non-finite
        if torch.ops.tallyserve_cpu.write_kv_cache_(k, v, kv_cache, slot_mapping):
            k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
            v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        return k, v
    k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    write_kv_cache(k, v, kv_cache, slot_mapping, kv_scale)
    return k, v
