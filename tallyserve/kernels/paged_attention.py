"""The Triton kernels of paged attention (``triton_attn.py`` sizes and launches them).

Reference: ``torch_ref.paged_attention`` (the parity target; tests/unit/test_triton_interpret.py
runs these kernels under ``TRITON_INTERPRET=1`` against it, tests/gpu at full size).

Two kernels cover a mixed batch, each skipping the other's requests (decided on the device):
  * ``prefill_kernel``: requests with more than one query row (prefill chunks over a cached
    prefix, causal within the chunk). A program owns one KV head and a tile of BLOCK_Q query
    tokens x all GROUP query heads of that KV head (rows = token * G_PAD + head), so each K/V
    tile is loaded once for the whole GQA group. Programs find their request by a binary search
    over query_start_loc: request i owns program ids [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q
    + i + 1), which always covers its cdiv(len, BLOCK_Q) tiles; spare programs exit. So the grid
    (T // BLOCK_Q + num_reqs, Hkv) needs only host-known sizes.
  * ``decode_kernel`` (+ ``reduce_kernel``): requests with one query row, split-K over the
    context (flash decoding) when there are too few (request, KV head) pairs to fill the GPU;
    each split writes a normalised partial output and its log-sum-exp, the reduce merges them.
  * ``cascade_prefix_kernel``: decode rows whose first KV blocks are one prefix every request
    shares (cascade attention): the prefix attended once per KV tile for a tile of request x head
    rows; ``decode_kernel`` (CASCADE) then attends each request's own keys and the reduce merges.
All use fp32 accumulation and an online softmax in base 2. Every length is read from device
tensors; host values only pick tile sizes and grid bounds, so a decode step can be captured in a
CUDA graph (capture with ``max_seq_len`` set to the capture-time bound). A request with
``seq_len == 0`` (CUDA-graph padding) produces zeros and reads nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tallyserve.kernels import pdl

LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so a fully masked tile gives exp2(-inf) = 0, not NaN
MAX_HEAD_DIM = 256


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, n0, kv_end, q_pos, kv_head,
    offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
):
    """One BLOCK_N tile of keys [n0, n0 + BLOCK_N) through the block table: online-softmax update
    of (acc, m_i, l_i). Unmasked tiles must lie wholly below kv_end and be visible to every row.
    With EVEN_D (head_dim a power of two >= 16) loads carry no mask along head_dim, so they stay
    vectorised; masked positions load 0, never an unwritten (possibly NaN) slot."""
    k_pos = n0 + offs_n
    if MASKED:
        mask_n = k_pos < kv_end
        block = tl.load(bt_row_ptr + k_pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
    base = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
    k_ptrs = k_cache_ptr + base[None, :] + offs_d[:, None]  # (D, N): K transposed
    v_ptrs = v_cache_ptr + base[:, None] + offs_d[None, :]  # (N, D)
    if EVEN_D:
        if MASKED:
            k_t = tl.load(k_ptrs, mask=mask_n[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    elif MASKED:
        k_t = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    else:
        k_t = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # kv_cache_dtype="fp8": k_scale is in qk_scale
        k_t = k_t.to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    s = tl.dot(q, k_t, input_precision=PREC) * qk_scale
    if MASKED:
        valid = mask_n[None, :]
        if CAUSAL:
            valid = valid & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_split(
    q, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_start, kv_end, split, num_splits, offs_m, kv_head,
    offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, PREC: tl.constexpr,
):
    """Split ``split`` of ``num_splits`` (whole BLOCK_N tiles each) of keys [kv_start, kv_end), every
    row seeing every key: the normalised output, the running max and the sum of exponentials."""
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    n_start = kv_start + split * chunk
    n_end = tl.minimum(n_start + chunk, kv_end)
    for n0 in range(n_start, n_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, n0, n_end, offs_m, kv_head,
            offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
            BLOCK_SIZE=BLOCK_SIZE, MASKED=True, CAUSAL=False, EVEN_D=EVEN_D, PREC=PREC)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i


# Runtime sizes are not specialised (Triton would otherwise compile a variant for value 1 and for
# multiples of 16 of each, at a second or more per compile mid-run), so batches of any size and
# block-table width reuse one compiled kernel per tile shape.
@triton.jit(do_not_specialize=["num_reqs", "search_steps", "stride_bt"])
def prefill_kernel(
    q_ptr, o_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, num_reqs, search_steps, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The request of this program: the largest i with qsl[i] // BLOCK_Q + i <= pid.
    lo = pid * 0
    hi = lo + num_reqs - 1
    for _ in range(search_steps):  # search_steps = bit_length(num_reqs): a runtime bound, no recompiles
        mid = (lo + hi + 1) // 2
        go = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    req = lo
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    t0 = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q
    run = t0 < q_len
    if SKIP_DECODE:
        run = run & (q_len > 1)
    if run:
        seq_len = tl.load(seq_lens_ptr + req)
        first_pos = seq_len - q_len
        offs_m = tl.arange(0, BLOCK_Q * G_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        tok = t0 + offs_m // G_PAD
        head = kv_head * GROUP + offs_m % G_PAD
        row_ok = (tok < q_len) & (offs_m % G_PAD < GROUP)
        rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & mask_d[None, :], other=0.0)
        q_pos = first_pos + tok
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_Q * G_PAD], _NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        kv_end = first_pos + tl.minimum(t0 + BLOCK_Q, q_len)  # the tile's last row sees keys [0, kv_end)
        free_end = (first_pos + t0 + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        for n0 in range(0, free_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, n0, kv_end, q_pos, kv_head,
                offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
                BLOCK_SIZE=BLOCK_SIZE, MASKED=False, CAUSAL=False, EVEN_D=HEAD_DIM == D_PAD, PREC=PREC)
        for n0 in range(free_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row, n0, kv_end, q_pos, kv_head,
                offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
                BLOCK_SIZE=BLOCK_SIZE, MASKED=True, CAUSAL=True, EVEN_D=HEAD_DIM == D_PAD, PREC=PREC)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=["num_splits", "num_slots", "stride_bt"])
def decode_kernel(
    q_ptr, o_ptr, part_o_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, prefix_len_ptr,
    qk_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_co, stride_ch,
    num_q_heads, num_splits, num_slots,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, CASCADE: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False,
):
    """Keys [kv_start, seq_len) of one decode request and KV head, split ``num_splits`` ways. With
    CASCADE, kv_start is the shared prefix length (``cascade_prefix_kernel`` attends the keys below
    it) and the partials go to slots [0, num_splits) of the ``num_slots`` each query head has. ``PDL``:
    a dependent launch (kernels/pdl.py). ``HEADS_FIRST``: the grid is (KV heads, requests, splits), so
    programs that run together read the KV heads of one request (one cache row holds them side by side);
    else (requests, KV heads, splits)."""
    pdl.enter(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_len == 1:
        seq_len = tl.load(seq_lens_ptr + req)
        kv_start = seq_len * 0
        if CASCADE:
            kv_start = tl.minimum(tl.load(prefix_len_ptr), seq_len)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < HEAD_DIM
        row_ok = offs_m < GROUP
        head = kv_head * GROUP + offs_m
        row = q_start.to(tl.int64)
        q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & mask_d[None, :], other=0.0)
        bt_row = bt_ptr + req.to(tl.int64) * stride_bt
        out, m_i, l_i = _attend_split(
            q, k_cache_ptr, v_cache_ptr, bt_row, kv_start, seq_len, split, num_splits, offs_m, kv_head,
            offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
            BLOCK_M=BLOCK_M, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, EVEN_D=HEAD_DIM == D_PAD, PREC=PREC)
        if not SPLIT:
            tl.store(o_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
        else:
            # partials: lse (num_reqs, Hq, num_slots) and outputs (num_reqs, Hq, num_slots, D_PAD), fp32
            part = (req.to(tl.int64) * num_q_heads + head) * num_slots + split
            tl.store(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], out, mask=row_ok[:, None] & mask_d[None, :])
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "num_slots", "slot0"])
def cascade_prefix_kernel(
    q_ptr, part_o_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, prefix_len_ptr,
    qk_scale, v_scale, stride_qt, stride_qh, stride_cb, stride_co, stride_ch, num_reqs, num_q_heads, num_splits,
    num_slots, slot0,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    """Cascade attention, shared half: keys [0, prefix_len) that every decode request reads from the
    same blocks (row 0 of the block table), attended once per KV tile for a tile of BLOCK_M query
    rows (request x query head of this KV head, row = req * GROUP + g), so the prefix is read once
    per step, not once per request. Split ``num_splits`` ways over the prefix; split s writes slot
    slot0 + s. Rows of padding requests (seq_len 0) get lse -inf, so they merge to zeros. A real row
    shorter than the prefix would too: ``common_prefix_len`` never names one (it stays below every
    request's length), so no producer of metadata creates such a row."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(prefix_len_ptr)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    req = offs_m // GROUP
    in_batch = req < num_reqs
    seq_len = tl.load(seq_lens_ptr + req, mask=in_batch, other=0)
    row_ok = in_batch & (seq_len > 0) & (seq_len >= prefix_len)
    head = kv_head * GROUP + offs_m % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    row = tl.load(qsl_ptr + req, mask=in_batch, other=0).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    out, m_i, l_i = _attend_split(
        q, k_cache_ptr, v_cache_ptr, bt_ptr, prefix_len * 0, prefix_len, split, num_splits, offs_m, kv_head,
        offs_n, offs_d, mask_d, qk_scale, v_scale, stride_cb, stride_co, stride_ch,
        BLOCK_M=BLOCK_M, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, EVEN_D=HEAD_DIM == D_PAD, PREC=PREC)
    lse = tl.where(row_ok & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    part = (req.to(tl.int64) * num_q_heads + head) * num_slots + slot0 + split
    tl.store(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], out, mask=in_batch[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + part, lse, mask=in_batch)


@triton.jit(do_not_specialize=["num_splits"])
def reduce_kernel(
    o_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, stride_ot, stride_oh, num_q_heads, num_splits,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the splits of one (decode request, query head): weights exp2(lse_s - max lse). ``PDL``: a
    dependent launch (kernels/pdl.py)."""
    pdl.enter(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_len == 1:
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask_s = offs_s < num_splits
        part = (req.to(tl.int64) * num_q_heads + head) * num_splits + offs_s
        lse = tl.load(part_lse_ptr + part, mask=mask_s, other=float("-inf"))
        top = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
        parts = tl.load(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=mask_s[:, None], other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)
