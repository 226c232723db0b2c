"""The Triton attention kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests (test_triton_interpret.py) check what the kernels compute; this checks that the
compiler accepts them (types of loop-carried values, constexpr branches, nested jit helpers) for every
variant the engine launches, so a kernel that only fails to compile on a GPU fails here first, and that
the compiled code is what each variant promises: its matrix products on tensor cores (Hopper's warpgroup
wgmma where a tile has 64 rows or more), its constexpr branches reading and writing the pointers of their
mode and no others, the dtype it stores. Triton ships ptxas with its NVIDIA backend; the test skips where
that backend is missing."""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older Triton
    GPUTarget = ASTSource = None

pytestmark = pytest.mark.skipif(GPUTarget is None, reason="this Triton cannot compile ahead of time")

PTRS = {"cos_ptr": "fp32", "sin_ptr": "fp32", "qw_ptr": "bf16", "kw_ptr": "bf16", "k_ptr": "bf16", "v_ptr": "bf16",
        "slot_ptr": "i64", "cache_ptr": "bf16", "q_ptr": "bf16", "o_ptr": "bf16", "k_cache_ptr": "bf16",
        "v_cache_ptr": "bf16", "bt_ptr": "i32",
        "qsl_ptr": "i32", "seq_lens_ptr": "i32", "prefix_len_ptr": "i32", "part_o_ptr": "fp32",
        "part_lse_ptr": "fp32", "x_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "res_ptr": "bf16", "s_ptr": "fp32"}
FLOATS = ("qk_scale", "eps", "v_scale", "inv_k_scale", "inv_v_scale")


def _compile(fn, constexprs: dict, num_warps: int = 4, ptrs: dict | None = None) -> str:
    params = list(inspect.signature(fn.fn).parameters)
    unknown = set(constexprs) - set(params)
    assert not unknown, f"not parameters of {fn.fn.__name__}: {unknown}"
    # constexprs not given take their defaults, as at a launch (left out, they would compile as runtime ints and
    # both sides of their branches with them: a variant the engine never launches)
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**{k: v for k, v in defaults.items() if k not in constexprs}, **constexprs}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexprs of {fn.fn.__name__} without a value: {missing}"
    types = {**PTRS, **(ptrs or {})}
    sig = {p: "constexpr" if p in constexprs else ("*" + types[p] if p in types else "fp32" if p in FLOATS else "i32")
           for p in params}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "enable_fp_fusion": True})
    except RuntimeError as exc:  # no NVIDIA toolchain in this Triton build
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"no NVIDIA backend: {exc}")
        raise
    return kernel.asm["ptx"]


HEADS = dict(HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, PREC="tf32")
# bf16 x bf16 -> f32 products on tensor cores: mma.sync for small tiles, Hopper's warpgroup wgmma for 64-row ones
MMA = re.compile(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b")
WGMMA = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16\b")


def _pointers_read(fn, ptx: str) -> set[str]:
    """The pointer arguments the compiled kernel loads from its parameter space (an argument no branch of this
    variant touches is never loaded), by name."""
    runtime = [p.name for p in fn.params if not p.is_constexpr]
    name = fn.fn.__name__
    used = {int(i) for i in re.findall(rf"ld\.param\.\w+\s+%\w+,\s*\[{name}_param_(\d+)\]", ptx)}
    assert used, f"no parameter loads found in {name}'s PTX"
    return {runtime[i] for i in used if i < len(runtime) and runtime[i].endswith("_ptr")}


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_decode_kernel_compiles(cascade, split):
    """Each mode reads and writes exactly its pointers: SPLIT writes float32 partials (outputs and log-sum-exps)
    and never the bfloat16 output, else the reverse; CASCADE reads the shared prefix's length, else never. The
    head group's scores and weighted values run on tensor cores; no dependent-launch code (PDL off)."""
    from tallyserve.kernels.paged_attention import decode_kernel

    ptx = _compile(decode_kernel, dict(GROUP=4, BLOCK_M=16, BLOCK_N=64, SPLIT=split, CASCADE=cascade, **HEADS))
    common = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "bt_ptr", "qsl_ptr", "seq_lens_ptr"}
    outputs = {"part_o_ptr", "part_lse_ptr"} if split else {"o_ptr"}
    assert _pointers_read(decode_kernel, ptx) == common | outputs | ({"prefix_len_ptr"} if cascade else set())
    assert len(MMA.findall(ptx)) >= 2  # q.K^T and p.V
    if split:  # float32 partials only
        assert "st.global.b32" in ptx and "st.global.b16" not in ptx
    else:  # the output rounded to bfloat16 and stored as such
        assert "cvt.rn.bf16x2.f32" in ptx and "st.global.b16" in ptx and "st.global.b32" not in ptx
    assert "griddepcontrol" not in ptx


@pytest.mark.parametrize("group,head_dim,d_pad,block_m,block_n", [(4, 128, 128, 64, 64), (3, 80, 128, 64, 32),
                                                                  (8, 64, 64, 128, 64)])
def test_cascade_prefix_kernel_compiles(group, head_dim, d_pad, block_m, block_n):
    """The shared prefix's tile of BLOCK_M (>= 64) query rows multiplies on Hopper's warpgroup MMA (wgmma, the point
    of attending the prefix once for many rows on an H100/H200) and writes float32 partials only."""
    from tallyserve.kernels.paged_attention import cascade_prefix_kernel

    ptx = _compile(cascade_prefix_kernel, dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=16,
                                                BLOCK_M=block_m, BLOCK_N=block_n, PREC="tf32"))
    assert len(WGMMA.findall(ptx)) >= 2 and "wgmma.wait_group.sync.aligned" in ptx
    assert _pointers_read(cascade_prefix_kernel, ptx) == {
        "q_ptr", "part_o_ptr", "part_lse_ptr", "k_cache_ptr", "v_cache_ptr", "bt_ptr", "qsl_ptr", "seq_lens_ptr",
        "prefix_len_ptr"}
    assert "st.global.b32" in ptx and "st.global.b16" not in ptx


def test_prefill_and_reduce_kernels_compile():
    """The prefill's tiles of query rows multiply on wgmma and store bfloat16 outputs; the reduce merges float32
    partials into the bfloat16 output with no matrix product at all."""
    from tallyserve.kernels.paged_attention import prefill_kernel, reduce_kernel

    ptx = _compile(prefill_kernel, dict(GROUP=4, G_PAD=4, BLOCK_Q=32, BLOCK_N=32, SKIP_DECODE=True, **HEADS))
    assert len(WGMMA.findall(ptx)) >= 2
    assert "st.global.b16" in ptx and "st.global.b32" not in ptx
    assert _pointers_read(prefill_kernel, ptx) == {"q_ptr", "o_ptr", "k_cache_ptr", "v_cache_ptr", "bt_ptr",
                                                   "qsl_ptr", "seq_lens_ptr"}
    ptx = _compile(reduce_kernel, dict(HEAD_DIM=128, D_PAD=128, S_PAD=32), num_warps=1)
    assert _pointers_read(reduce_kernel, ptx) == {"o_ptr", "part_o_ptr", "part_lse_ptr", "qsl_ptr"}
    assert "cvt.rn.bf16.f32" in ptx and "st.global.b16" in ptx and "st.global.b32" not in ptx
    assert not MMA.search(ptx) and not WGMMA.search(ptx) and "griddepcontrol" not in ptx


@pytest.mark.parametrize("silu_mul,even_k", [(False, True), (True, True), (False, False)])
def test_gemv_kernel_compiles_with_dependent_launch(silu_mul, even_k):
    from tallyserve.kernels import pdl
    from tallyserve.kernels.gemv import _gemv_kernel

    if not pdl._GDC:
        pytest.skip("this Triton has no grid dependency control")
    ptx = _compile(_gemv_kernel, dict(BLOCK_N=8, BLOCK_K=512, EVEN_K=even_k, SILU_MUL=silu_mul, PDL=True))
    # it may start early (launch_dependents), loads its first weight tile, then waits for the kernel before it
    assert "griddepcontrol.launch_dependents" in ptx
    assert 0 <= ptx.find("ld.global") < ptx.find("griddepcontrol.wait")
    plain = _compile(_gemv_kernel, dict(BLOCK_N=8, BLOCK_K=512, EVEN_K=even_k, SILU_MUL=silu_mul, PDL=False))
    assert "griddepcontrol" not in plain


def test_the_other_decode_kernels_are_dependent_launches():
    from tallyserve.kernels.kv_cache_write import _write_kv_kernel
    from tallyserve.kernels.paged_attention import decode_kernel, reduce_kernel
    from tallyserve.kernels import pdl
    from tallyserve.kernels.fused_ops import (
        _add_rms_norm_kernel, _qk_norm_rotary_kernel, _rotary_kernel, _rotary_write_kv_kernel,
    )

    if not pdl._GDC:
        pytest.skip("this Triton has no grid dependency control")
    for fn, consts, warps in [
            (_add_rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096), 4),
            (_rotary_kernel, dict(HALF=64, BLOCK=64), 1),
            (_qk_norm_rotary_kernel, dict(NUM_Q_HEADS=32, HALF=64, BLOCK=64), 1),
            (_rotary_write_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_SIZE=16, HALF=64, BLOCK=64, HEADS=16,
                                           QK_NORM=True), 1),
            (_rotary_write_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_SIZE=16, HALF=64, BLOCK=64, HEADS=16,
                                           QK_NORM=False), 1),
            (_write_kv_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=128, ROW=1024, BLOCK=1024), 4),
            (reduce_kernel, dict(HEAD_DIM=128, D_PAD=128, S_PAD=32), 1),
            (decode_kernel, dict(GROUP=4, BLOCK_M=16, BLOCK_N=64, SPLIT=True, CASCADE=False, **HEADS), 4)]:
        ptx = _compile(fn, dict(consts, PDL=True), num_warps=warps)
        # the wait comes before any load: nothing an earlier kernel writes is read before it
        assert "griddepcontrol.launch_dependents" in ptx, fn.fn.__name__
        assert 0 <= ptx.find("griddepcontrol.wait") < ptx.find("ld.global"), fn.fn.__name__
        assert "griddepcontrol" not in _compile(fn, dict(consts, PDL=False), num_warps=warps), fn.fn.__name__


# FP8 e4m3 x e4m3 -> f32 products: Hopper's warpgroup wgmma (k32 per instruction for 8-bit operands), or mma.sync
FP8_MMA = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3|mma\.sync\.aligned\.m16n8k32\.row\.col"
                     r"\.f32\.e4m3\.e4m3\.f32)\b")
MMA_F16 = re.compile(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32\b")
FP8_GEMM_PTRS = {"a_ptr": "fp8e4nv", "b_ptr": "fp8e4nv", "c_ptr": "bf16", "as_ptr": "fp32", "bs_ptr": "fp32",
                 "bias_ptr": "bf16"}


@pytest.mark.parametrize("block_m,block_n,warps", [(128, 128, 8), (16, 64, 4)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_fp8_gemm_kernel_compiles(block_m, block_n, warps, has_bias):
    """The FP8 product's 128-row tiles multiply e4m3 by e4m3 on Hopper's wgmma; 16-row tiles (decode batches, where
    the weight read is the cost) convert e4m3 to f16 in registers for mma.sync. Both read the two scale arrays, the
    bias only when there is one, and store bfloat16."""
    from tallyserve.kernels.fp8_gemm import _fp8_gemm_kernel

    ptx = _compile(_fp8_gemm_kernel, dict(SCALE_BN=128, SCALE_BK=128, HAS_BIAS=has_bias, BLOCK_M=block_m,
                                          BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, PDL=False), num_warps=warps,
                   ptrs=FP8_GEMM_PTRS)
    if block_m >= 64:
        assert FP8_MMA.search(ptx) and "wgmma.mma_async" in ptx, "no e4m3 wgmma"
    else:
        assert "cvt.rn.f16x2.e4m3x2" in ptx and MMA_F16.search(ptx)
    want = {"a_ptr", "b_ptr", "c_ptr", "as_ptr", "bs_ptr"} | ({"bias_ptr"} if has_bias else set())
    assert _pointers_read(_fp8_gemm_kernel, ptx) == want
    assert "st.global.b16" in ptx or "st.global.v4.b16" in ptx or "st.global.v2.b32" in ptx


@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantize_rows_kernel_compiles(static):
    """Activation quantization rounds to e4m3 with saturation; a static scale is read, never written."""
    from tallyserve.kernels.fp8_gemm import _quantize_rows_kernel

    ptx = _compile(_quantize_rows_kernel, dict(GROUP=128, STATIC=static, PDL=False),
                   ptrs={"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32", "static_ptr": "fp32"})
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    used = _pointers_read(_quantize_rows_kernel, ptx)
    assert used == ({"x_ptr", "q_ptr", "static_ptr"} if static else {"x_ptr", "q_ptr", "s_ptr"})


@pytest.mark.parametrize("scale", [1, 2])
def test_gemv_kernel_with_an_fp8_weight_compiles(scale):
    """The one-row product over an FP8 weight converts e4m3 pairs in registers and reads its scales."""
    from tallyserve.kernels.gemv import _gemv_kernel

    ptx = _compile(_gemv_kernel, dict(BLOCK_N=16, BLOCK_K=128, EVEN_K=True, SILU_MUL=False, PDL=False, SCALE=scale,
                                      SCALE_BN=128, SCALE_BK=128), ptrs={"w_ptr": "fp8e4nv"})
    assert re.search(r"cvt\.rn\.(f16x2|bf16x2)\.e4m3x2", ptx)
    assert "s_ptr" in _pointers_read(_gemv_kernel, ptx)


FP8_CACHE = {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv", "cache_ptr": "fp8e4nv"}


def test_attention_kernels_read_an_fp8_cache():
    """kv_cache_dtype="fp8": decode, prefill and cascade load e4m3 K/V, convert them to bf16 pairs in registers and
    still multiply bf16 on the tensor cores."""
    from tallyserve.kernels.paged_attention import cascade_prefix_kernel, decode_kernel, prefill_kernel

    for fn, consts in ((decode_kernel, dict(GROUP=4, BLOCK_M=16, BLOCK_N=64, SPLIT=True, CASCADE=False, **HEADS)),
                       (prefill_kernel, dict(GROUP=4, G_PAD=4, BLOCK_Q=32, BLOCK_N=32, SKIP_DECODE=True, **HEADS)),
                       (cascade_prefix_kernel, dict(GROUP=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=64,
                                                    BLOCK_N=64, PREC="tf32"))):
        ptx = _compile(fn, consts, ptrs=FP8_CACHE)
        assert re.search(r"cvt\.rn\.(bf16x2|f16x2)\.e4m3x2", ptx), fn.fn.__name__
        assert MMA.search(ptx) or WGMMA.search(ptx), fn.fn.__name__


def test_kv_writers_store_saturated_fp8():
    """The KV write and the fused rotary + KV write round to e4m3 with saturation into an FP8 cache."""
    from tallyserve.kernels.fused_ops import _rotary_write_kv_kernel
    from tallyserve.kernels.kv_cache_write import _write_kv_kernel

    ptx = _compile(_write_kv_kernel, dict(BLOCK_SIZE=16, HEAD_DIM=128, ROW=1024, BLOCK=1024, PDL=False),
                   ptrs={**FP8_CACHE, "k_ptr": "bf16", "v_ptr": "bf16"})
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    ptx = _compile(_rotary_write_kv_kernel, dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, BLOCK_SIZE=16, HALF=64, BLOCK=64,
                                                 HEADS=16, QK_NORM=False, PDL=False), ptrs=FP8_CACHE)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("block_m,by_token,mul_weight", [(16, True, False), (64, False, True)])
def test_fused_moe_gemm_compiles(block_m, by_token, mul_weight):
    """The grouped expert GEMM multiplies bf16 tiles on the tensor cores, reads the routing weights only in the down
    product, and stores bfloat16."""
    from tallyserve.kernels.fused_moe import _moe_gemm_kernel

    ptx = _compile(_moe_gemm_kernel, dict(TOP_K=8, A_BY_TOKEN=by_token, MUL_WEIGHT=mul_weight, BLOCK_M=block_m,
                                          BLOCK_N=64, BLOCK_K=64, PREC="tf32"),
                   ptrs={"a_ptr": "bf16", "w_ptr": "bf16", "c_ptr": "bf16", "sorted_ptr": "i64",
                         "tile_expert_ptr": "i64", "weight_ptr": "fp32"})
    assert MMA.search(ptx) or WGMMA.search(ptx)
    assert ("weight_ptr" in _pointers_read(_moe_gemm_kernel, ptx)) == mul_weight
    assert "st.global.b16" in ptx or "st.global.v4.b32" in ptx or "st.global.v2.b32" in ptx
