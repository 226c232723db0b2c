"""FP8 products on CUDA (compute capability 8.9+: Ada, Hopper): ``linear`` computes ``x @ W^T`` for an FP8 e4m3
weight W (N, K) with float32 scales, one per output row or one per (bn, bk) block.

  * Activation quantization (``quantize_rows``): one Triton kernel reads each row once for its absolute maximum
    (per row, or per group of ``group`` columns) and writes the e4m3 row and its scales; a static scale skips the
    maximum.
  * One row (the batch-1 decode step): ``kernels/gemv`` with the weight in FP8: it streams half the bytes of a
    bf16 weight and scales in registers (no activation quantization: the row stays in bf16).
  * Per-row weight scales: ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM with row-wise scales), or this module's
    Triton kernel where ``CHANNEL_BACKEND`` records that it measured faster for the shape
    (``benchmarks/kernels.py fp8-gemm``).
  * Block scales: the Triton kernel: for every K tile (one scale block wide) it multiplies the FP8 tiles on the
    tensor cores and adds the product times the activation's group scale and the weight's block scale.
"""

from __future__ import annotations

from typing import Optional

import torch

from tallyserve.kernels import gemv, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_supported: dict[int, bool] = {}
# (N, K) -> "scaled_mm" | "triton": which per-row-scaled product ran faster at that shape
# (`benchmarks/kernels.py fp8-gemm`); empty until that is measured on an H100, so every shape uses scaled_mm
CHANNEL_BACKEND: dict[tuple[int, int], str] = {}


def supported(device: torch.device) -> bool:
    """Triton is there and the device has FP8 tensor cores (compute capability 8.9 or later)."""
    if triton is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        _supported[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _supported[index]


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm, stride_sm,
                              GROUP: tl.constexpr, STATIC: tl.constexpr, PDL: tl.constexpr):
        """Program (row, group): the group's scale (amax / 448, or the static one) and its e4m3 values. GROUP
        covers the whole row (a power of two >= K) for per-row scales."""
        pdl.enter(PDL)
        row = tl.program_id(0)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
            tl.store(s_ptr + row * stride_sm + g, scale)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row.to(tl.int64) * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                         stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         PDL: tl.constexpr):
        """C (M, N) = sum over K tiles of (A_tile @ B_tile^T) * a_scale[m, k-group] * b_scale[n-block, k-block].
        A (M, K) and B (N, K) are e4m3. Per-row weight scales: SCALE_BN 1 and stride_bsk 0; per-token activation
        scales: stride_ask 0. BLOCK_K divides SCALE_BK (one scale per K tile)."""
        pdl.enter(PDL)
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % rows
        pid_n = (pid % group) // rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m * stride_asm
        bs_ptrs = bs_ptr + (offs_n // SCALE_BN) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            kg = k0 // SCALE_BK
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_rows(x: torch.Tensor, group: Optional[int] = None,
                  static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, float32 scales) of a (M, K) CUDA activation: scales (M, 1) per row (``group`` None), (M, K / group)
    per group, or the static 0-d ``static_scale`` repeated as (M, 1)."""
    m, k = x.shape
    x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float().expand(m, 1)
        width, groups = triton.next_power_of_2(k), 1
        s_out = scale  # not written
    else:
        width = group if group is not None else triton.next_power_of_2(k)
        groups = triton.cdiv(k, width)
        s_out = scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        static = static_scale if static_scale is not None else s_out
        _quantize_rows_kernel[(m, groups)](x, q, s_out, static, k, x.stride(0), q.stride(0), s_out.stride(0),
                                           GROUP=width, STATIC=static_scale is not None,
                                           num_warps=4 if width <= 2048 else 8, **pdl.launch_options(x.device))
    return q, scale


def _gemm_config(m: int, n: int, k: int, scale_bk: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_k = min(128, scale_bk)
    if m <= 16:
        return 16, 64, block_k, 4, 4
    if m <= 64:
        return 64, 64, block_k, 4, 4
    return 128, 128, block_k, 8, 3


def triton_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                block: Optional[tuple[int, int]], bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                group: int) -> torch.Tensor:
    """The Triton product of quantized A (M, K) and B (N, K) with their scales (see ``_fp8_gemm_kernel``)."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if block is not None:
        scale_bn, scale_bk = block
        stride_bsn, stride_bsk = b_scale.stride(0), b_scale.stride(1)
    else:
        scale_bn, scale_bk = 1, group if a_scale.shape[1] > 1 else 128
        stride_bsn, stride_bsk = b_scale.stride(0), 0
    stride_ask = a_scale.stride(1) if a_scale.shape[1] > 1 else 0
    if a_scale.shape[1] > 1 and group != scale_bk:
        raise ValueError(f"activation groups of {group} do not match weight blocks of {scale_bk} columns")
    bm, bn, bk, warps, stages = _gemm_config(m, n, k, scale_bk)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](a, b, out, a_scale, b_scale, bias if bias is not None else out, m, n, k,
                           a.stride(0), b.stride(0), out.stride(0), a_scale.stride(0), stride_ask,
                           stride_bsn, stride_bsk, SCALE_BN=scale_bn, SCALE_BK=scale_bk, HAS_BIAS=bias is not None,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
                           **pdl.launch_options(a.device))
    return out


def channel_backend(n: int, k: int) -> str:
    return CHANNEL_BACKEND.get((n, k), "scaled_mm")


def _scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1), out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    if bias is not None:
        out = out.add_(bias)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
           activation: str, input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for an e4m3 ``weight`` (N, K) with float32 ``scale`` ((N,) per row, or per
    ``block``), its input quantized per ``activation`` ("token", "group", "tensor", "static"); out_dtype out."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n, k = weight.shape
    if x2.shape[1] != k:
        raise ValueError(f"fp8 linear: x {tuple(shape)} does not match the weight {tuple(weight.shape)}")
    if x2.shape[0] == 1 and gemv.usable_fp8(x2, weight):
        out = gemv.gemv(x2, weight, out_dtype, scale=scale, scale_block=block)
        out = out if bias is None else out.add_(bias)
        return out.reshape(*shape[:-1], n)
    group = block[1] if block is not None else None
    if activation == "static":
        xq, xs = quantize_rows(x2, static_scale=input_scale)
    elif activation == "group":
        xq, xs = quantize_rows(x2, group=group or 128)
    elif activation == "tensor":
        xq, xs = quantize_rows(x2)
        xs = xs.amax().reshape(1, 1).expand(x2.shape[0], 1)  # one scale for the matrix: the largest row's
        xq, _ = quantize_rows(x2, static_scale=xs[0, 0])
    else:
        xq, xs = quantize_rows(x2)
    if block is None and channel_backend(n, k) == "scaled_mm" and k % 16 == 0 and n % 16 == 0:
        out = _scaled_mm(xq, xs.contiguous(), weight, scale, bias, out_dtype)
    else:
        out = triton_gemm(xq, xs, weight, scale.reshape(-1, 1) if block is None else scale, block, bias, out_dtype,
                          group or 128)
    return out.reshape(*shape[:-1], n)
