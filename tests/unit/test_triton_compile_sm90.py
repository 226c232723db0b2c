"""The Triton attention kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests (test_triton_interpret.py) check what the kernels compute; this checks that the
compiler accepts them (types of loop-carried values, constexpr branches, nested jit helpers) for every
variant the engine launches, so a kernel that only fails to compile on a GPU fails here first. Triton
ships ptxas with its NVIDIA backend; the test skips where that backend is missing."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older Triton
    GPUTarget = ASTSource = None

pytestmark = pytest.mark.skipif(GPUTarget is None, reason="this Triton cannot compile ahead of time")

PTRS = {"q_ptr": "bf16", "o_ptr": "bf16", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16", "bt_ptr": "i32",
        "qsl_ptr": "i32", "seq_lens_ptr": "i32", "prefix_len_ptr": "i32", "part_o_ptr": "fp32",
        "part_lse_ptr": "fp32"}


def _compile(fn, constexprs: dict, num_warps: int = 4) -> str:
    params = list(inspect.signature(fn.fn).parameters)
    unknown = set(constexprs) - set(params)
    assert not unknown, f"not parameters of {fn.fn.__name__}: {unknown}"
    sig = {p: "constexpr" if p in constexprs else ("*" + PTRS[p] if p in PTRS else "fp32" if p == "qk_scale" else "i32")
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


@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_decode_kernel_compiles(cascade, split):
    from tallyserve.attention.triton_kernels import _decode_kernel

    ptx = _compile(_decode_kernel, dict(GROUP=4, BLOCK_M=16, BLOCK_N=64, SPLIT=split, CASCADE=cascade, **HEADS))
    assert "_decode_kernel" in ptx


@pytest.mark.parametrize("group,head_dim,d_pad,block_m,block_n", [(4, 128, 128, 64, 64), (3, 80, 128, 64, 32),
                                                                  (8, 64, 64, 128, 64)])
def test_cascade_prefix_kernel_compiles(group, head_dim, d_pad, block_m, block_n):
    from tallyserve.attention.triton_kernels import _cascade_prefix_kernel

    ptx = _compile(_cascade_prefix_kernel, dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=16,
                                                BLOCK_M=block_m, BLOCK_N=block_n, PREC="tf32"))
    assert "_cascade_prefix_kernel" in ptx


def test_prefill_and_reduce_kernels_compile():
    from tallyserve.attention.triton_kernels import _prefill_kernel, _reduce_kernel

    assert "_prefill_kernel" in _compile(_prefill_kernel, dict(GROUP=4, G_PAD=4, BLOCK_Q=32, BLOCK_N=32,
                                                               SKIP_DECODE=True, **HEADS))
    assert "_reduce_kernel" in _compile(_reduce_kernel, dict(HEAD_DIM=128, D_PAD=128, S_PAD=32), num_warps=1)
