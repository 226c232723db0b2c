"""The AMX attention path for chunks over a bfloat16 cache, checked without AMX hardware (test_attention_amx.py needs a
CPU with AMX-BF16 and skips elsewhere).

Two checks of the same logic:
  * the kernel's own code, ``attention_amx_cpu.cpp`` unchanged, built with its AMX path on and every tile
    instruction replaced by software tiles (``tests/amx_emulation/amx_emulation.h``, force-included: TDPBF16PS as
    Intel's pseudocode defines it) and called item by item as ``paged_attention_cpu.cpp`` calls it: the same answer
    as the float32 path to float32 rounding, against a float64 reference, on the shapes test_attention_amx.py uses.
    Needs g++ and AVX-512F (the kernel's vector code).
  * a PyTorch model of its arithmetic that runs everywhere: three truncated bfloat16 parts carry all of float32's
    bits, products of bfloat16 values are exact in float32, and the per-piece online softmax over 64-key pieces with
    the causal mask in the lanes gives the float32 path's answer, where one bfloat16 rounding of the queries would
    not."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tallyserve.kernels import cpu_kernels
from tests.unit.test_attention_amx import CASES, HEADS, _case, _dense_reference

CSRC = Path(cpu_kernels.__file__).parent / "csrc"
EMULATION = Path(__file__).resolve().parents[1] / "amx_emulation"
K_PIECE = 64  # attention_amx_cpu.cpp's kPiece: keys per piece of the online softmax


# ----------------------------------------------------------------------------- the kernel's code on emulated tiles


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The AMX code built with emulated tiles, as a ctypes library (skips without g++ or AVX-512F)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    native = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                            text=True, timeout=60).stdout
    if "__AVX512F__" not in native:
        pytest.skip("this CPU has no AVX-512F: the AMX code's vector parts cannot run here")
    library = tmp_path_factory.mktemp("amx-emulation") / "libamx_emulated.so"
    # the kernel's flags, its AMX path switched on (the tile instructions come only from the intrinsics the
    # emulation replaces); its namespace renamed and its symbols kept local, so it never meets the real kernels'
    cmd = [compiler, "-std=c++17", "-O2", "-march=native", "-mamx-tile", "-mamx-bf16", "-mavx512bf16",
           "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-fvisibility=hidden", "-Wl,-Bsymbolic",
           "-Dtallyserve_amx=tallyserve_amx_emulated", "-include", str(EMULATION / "amx_emulation.h"),
           f"-I{EMULATION}", f"-I{CSRC}", "-o", str(library), str(EMULATION / "amx_emulated.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lib = ctypes.CDLL(str(library))
    assert lib.amx_emulation_built(), "the kernel's AMX path was not compiled in"
    lib.amx_emulation_rows_per_item.restype = ctypes.c_long
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.amx_emulation_rows_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.amx_emulation_rows_bf16.restype = None
    return lib


def _attend_emulated(lib, q, cache, meta, split_heads: bool = False) -> torch.Tensor:
    """paged_attention_cpu.cpp's AMX route over ``cache`` (bfloat16), item by item: runs of up to kRowsPerItem query
    rows of one request, all heads (or, as with fewer items than threads, one KV head group per call)."""
    q = q.contiguous()
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    _, num_blocks, block_size, num_kv_heads, _ = cache.shape
    group = num_q_heads // num_kv_heads
    bits = cache.contiguous().view(torch.int16)
    k_base = bits.data_ptr()
    v_base = k_base + num_blocks * block_size * num_kv_heads * head_dim * 2  # V follows K, as the kernel reads it
    out = torch.zeros_like(q)
    per_item = lib.amx_emulation_rows_per_item()
    row = num_kv_heads * head_dim  # cache elements from one position to the next
    starts, lens, tables = meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_tables.tolist()
    heads = [(g * group, (g + 1) * group) for g in range(num_kv_heads)] if split_heads else [(0, num_q_heads)]
    for r in range(len(lens)):
        rows, length = starts[r + 1] - starts[r], lens[r]
        for lo in range(0, rows, per_item):
            hi = min(rows, lo + per_item)
            nkeys = length - rows + hi  # keys the item's last row sees
            row_off = torch.tensor([tables[r][j // block_size] * block_size * row + (j % block_size) * row
                                    for j in range(nkeys)], dtype=torch.int64)
            first = starts[r] + lo
            for h_lo, h_hi in heads:
                lib.amx_emulation_rows_bf16(
                    q.data_ptr() + first * num_q_heads * head_dim * 4, num_q_heads * head_dim,
                    out.data_ptr() + first * num_q_heads * head_dim * 4, num_q_heads * head_dim,
                    k_base, v_base, row_off.data_ptr(), hi - lo, length - rows + lo, h_lo, h_hi, group,
                    head_dim ** -0.5)
    return out


def _float32_path(q, cache, meta) -> torch.Tensor:
    """The kernel's float32 path over the same bfloat16 cache (the AMX path off), or a float32 dense attention where
    the kernels are not built."""
    if not cpu_kernels.load():
        return _dense_reference(q, *_full_kv(cache, meta), _reqs(meta), meta, torch.float32)
    ops = torch.ops.tallyserve_cpu
    was = ops.amx_usable()
    ops.set_amx(False)
    try:
        return ops.paged_attention(q, cache, meta.block_tables.to(torch.int32), meta.query_start_loc.to(torch.long),
                                   meta.seq_lens.to(torch.long), q.shape[2] ** -0.5)
    finally:
        ops.set_amx(was)


def _reqs(meta):
    starts = meta.query_start_loc_cpu
    return [(meta.seq_lens_cpu[i] - (starts[i + 1] - starts[i]), starts[i + 1] - starts[i])
            for i in range(len(meta.seq_lens_cpu))]


def _full_kv(cache, meta):
    """Each request's K and V, positions 0 .. seq_len - 1, read back from the cache."""
    bs = cache.shape[2]
    ks, vs = [], []
    for r, length in enumerate(meta.seq_lens_cpu):
        slots = [int(meta.block_tables[r, j // bs]) * bs + j % bs for j in range(length)]
        flat = cache.view(2, -1, cache.shape[3], cache.shape[4])
        ks.append(flat[0, slots])
        vs.append(flat[1, slots])
    return ks, vs


def _check_emulated(lib, reqs, hq, hkv, block_size, seed, q_scale=1.0):
    q, cache, meta, full_k, full_v = _case(reqs, hq, hkv, block_size, seed, q_scale)
    amx, f32 = _attend_emulated(lib, q, cache, meta), _float32_path(q, cache, meta)
    ref = _dense_reference(q, full_k, full_v, reqs, meta)
    err_amx, err_f32 = (amx.double() - ref).abs().max().item(), (f32.double() - ref).abs().max().item()
    # float32 rounding on both paths, only the order of the sums differs. The emulated TDPBF16PS rounds after every
    # product, as Intel's pseudocode writes it, and a score sums six tile products: a few more roundings than the
    # float32 path, so the bound is looser than test_attention_amx.py's (4x + 2e-6; 150 random cases stayed within
    # 3x + 1e-6), while a single bfloat16 rounding of q misses by far more (the wide-range test)
    assert err_amx <= 4 * err_f32 + 2e-6, (err_amx, err_f32)
    torch.testing.assert_close(amx, f32, atol=1e-5, rtol=1e-5)
    return q, cache, meta, amx


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("reqs,block_size", CASES)
def test_emulated_amx_code_equals_the_float32_path(emulated, hq, hkv, reqs, block_size):
    _check_emulated(emulated, reqs, hq, hkv, block_size, seed=hq * 7 + block_size)


def test_emulated_amx_code_split_by_head_group_is_the_same(emulated):
    """With fewer items than threads the kernel hands each KV head group to its own call: bit for bit the same."""
    q, cache, meta, whole = _check_emulated(emulated, [(30, 70), (0, 5)], 9, 3, 16, seed=11)
    assert torch.equal(_attend_emulated(emulated, q, cache, meta, split_heads=True), whole)


def test_emulated_amx_code_keeps_float32_precision_for_queries_of_wide_range(emulated):
    """As test_attention_amx.py: peaked scores and queries of mixed magnitudes need all three bfloat16 parts."""
    q, cache, meta, full_k, full_v = _case([(30, 50)], 9, 3, 16, seed=5, q_scale=30.0)
    q[:, :, ::2] *= 1e-3
    amx, f32 = _attend_emulated(emulated, q, cache, meta), _float32_path(q, cache, meta)
    ref = _dense_reference(q, full_k, full_v, [(30, 50)], meta)
    assert (amx.double() - ref).abs().max() <= 4 * (f32.double() - ref).abs().max() + 2e-6
    rounded = _float32_path(q.to(torch.bfloat16).float(), cache, meta)
    assert (rounded.double() - ref).abs().max() > 10 * (amx.double() - ref).abs().max()


@settings(max_examples=10, deadline=None, derandomize=True)
@given(reqs=st.lists(st.tuples(st.integers(0, 140), st.integers(1, 90)), min_size=1, max_size=3),
       heads=st.sampled_from([(9, 3), (8, 2), (4, 1), (2, 2)]), block_size=st.sampled_from([1, 8, 16]),
       seed=st.integers(0, 1000))
def test_emulated_amx_code_on_random_chunks(emulated, reqs, heads, block_size, seed):
    _check_emulated(emulated, reqs, heads[0], heads[1], block_size, seed)


def test_the_amx_path_is_taken_only_where_the_cpu_has_amx():
    """The kernel's switch: off whenever asked, and never on where the CPU lacks AMX-BF16 (paged_attention then keeps
    bfloat16 caches on the float32 path); test_attention_amx.py covers the AMX machines."""
    if not cpu_kernels.load():
        pytest.skip("the CPU kernels could not be built here")
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    ops = torch.ops.tallyserve_cpu
    was = ops.amx_usable()
    try:
        assert ops.set_amx(False) is False and ops.amx_usable() is False
        on = ops.set_amx(True)
        assert on is ops.amx_usable()
        if not {"amx_tile", "amx_bf16"} <= flags:
            assert on is False
    finally:
        ops.set_amx(was)


# ----------------------------------------------------------------------------- a PyTorch model of the arithmetic


def _bf16_part(x: torch.Tensor) -> torch.Tensor:
    """The top bits of float32 x that a bfloat16 holds, by truncation (the kernel's bf16_part: x's bits & 0xffff0000)."""
    return (x.view(torch.int32) & -65536).view(torch.float32)


def _split3(x: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's split3: x = p0 + p1 + p2, each part a bfloat16 value (8 significant bits each)."""
    p0 = _bf16_part(x)
    rest = x - p0
    p1 = _bf16_part(rest)
    return [p0, p1, _bf16_part(rest - p1)]


def test_three_truncated_bfloat16_parts_hold_every_float32_bit():
    """For normal numbers down to 2^-100 (so that the last part is not subnormal, which the kernel's comment notes
    AMX would read as zero anyway)."""
    gen = torch.Generator().manual_seed(0)
    mantissa = (1 + torch.rand(200_000, generator=gen)) * torch.where(torch.rand(200_000, generator=gen) < 0.5, -1, 1)
    x = mantissa * torch.exp2(torch.randint(-100, 101, (200_000,), generator=gen).float())
    parts = _split3(x)
    for p in parts:  # each part is a bfloat16 value exactly
        assert torch.equal(p.to(torch.bfloat16).float(), p)
    assert torch.equal(parts[0].double() + parts[1].double() + parts[2].double(), x.double())
    assert not torch.equal(parts[0], x)  # one part alone would not do


def test_products_of_bfloat16_values_are_exact_in_float32():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(100_000, generator=gen).to(torch.bfloat16).float()
    b = (torch.randn(100_000, generator=gen) * 1e3).to(torch.bfloat16).float()
    assert torch.equal((a * b).double(), a.double() * b.double())


def _model_rows(q, k, v, first: int, scale: float, parts: int = 3) -> torch.Tensor:
    """The AMX kernel's arithmetic for one KV head group of one item: q (H, R, 64) float32 rows at positions first ..
    first + R - 1, k / v (L, 64) bfloat16-valued keys. Scores^T = K . q^T over ``parts`` bfloat16 parts of q (each
    product exact, summed in float32); per piece of K_PIECE keys an online softmax with the causal mask per row;
    out^T += V^T . P^T over the three bfloat16 parts of P; out / sum."""
    heads, rows, _ = q.shape
    nkeys = first + rows
    pos = torch.arange(first, first + rows)
    q_parts = _split3(q)[:parts]
    top = torch.full((heads, rows), float("-inf"))
    total = torch.zeros(heads, rows)
    out = torch.zeros(heads, rows, q.shape[2])
    for c0 in range(0, nkeys, K_PIECE):
        kc, vc = k[c0:c0 + K_PIECE], v[c0:c0 + K_PIECE]
        s = sum(torch.einsum("kd,hrd->hrk", kc, p) for p in q_parts) * scale
        s = s.masked_fill(torch.arange(c0, c0 + kc.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
        new_top = torch.maximum(top, s.max(-1).values)
        corr = torch.where(top == float("-inf"), torch.zeros_like(top), torch.exp(top - new_top))
        p = torch.exp(s - new_top[..., None])  # masked keys: exp(-inf) = 0
        total = total * corr + p.sum(-1)
        out = out * corr[..., None] + sum(torch.einsum("hrk,kd->hrd", pp, vc) for pp in _split3(p))
        top = new_top
    return out / total[..., None]


def _model_attention(q, cache, meta, parts: int = 3) -> torch.Tensor:
    """_model_rows over every item (64 rows) and KV head group of a pass, as the kernel splits it."""
    full_k, full_v = _full_kv(cache, meta)
    hq, hkv, d = q.shape[1], cache.shape[3], q.shape[2]
    group = hq // hkv
    out = torch.zeros_like(q)
    for r, (cached, new) in enumerate(_reqs(meta)):
        lo = meta.query_start_loc_cpu[r]
        for i in range(0, new, 64):
            rows = q[lo + i:lo + min(new, i + 64)]
            for g in range(hkv):
                heads = slice(g * group, (g + 1) * group)
                res = _model_rows(rows[:, heads].transpose(0, 1), full_k[r][:, g].float(), full_v[r][:, g].float(),
                                  cached + i, d ** -0.5, parts)
                out[lo + i:lo + i + rows.shape[0], heads] = res.transpose(0, 1)
    return out


@pytest.mark.parametrize("hq,hkv,reqs,block_size", [
    (9, 3, [(0, 40)], 16), (8, 2, [(0, 150), (0, 1), (17, 33)], 16), (6, 1, [(200, 9), (5, 3)], 4),
    (4, 4, [(70, 66)], 32),
])
def test_model_of_the_amx_arithmetic_equals_float32_attention(hq, hkv, reqs, block_size):
    q, cache, meta, full_k, full_v = _case(reqs, hq, hkv, block_size, seed=hq + block_size)
    ref = _dense_reference(q, full_k, full_v, reqs, meta)
    dense32 = _dense_reference(q, full_k, full_v, reqs, meta, torch.float32)
    model = _model_attention(q, cache, meta)
    err_model, err_f32 = (model.double() - ref).abs().max().item(), (dense32.double() - ref).abs().max().item()
    assert err_model <= 2 * err_f32 + 1e-6, (err_model, err_f32)


def test_model_needs_all_three_parts_of_the_queries():
    """Peaked scores and queries of mixed magnitudes: the three-part model keeps float32 precision; with one part
    (a single bfloat16 rounding of q) it is off by far more."""
    q, cache, meta, full_k, full_v = _case([(30, 50)], 9, 3, 16, seed=5, q_scale=30.0)
    q[:, :, ::2] *= 1e-3
    ref = _dense_reference(q, full_k, full_v, [(30, 50)], meta)
    three = (_model_attention(q, cache, meta).double() - ref).abs().max()
    one = (_model_attention(q, cache, meta, parts=1).double() - ref).abs().max()
    dense32 = (_dense_reference(q, full_k, full_v, [(30, 50)], meta, torch.float32).double() - ref).abs().max()
    assert three <= 2 * dense32 + 1e-6
    assert one > 10 * three
