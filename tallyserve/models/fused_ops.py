"""Fused kernels for the forward pass: residual add + RMSNorm, in-place rotary
embedding of q and k together (with the per-head q/k RMSNorm of Qwen3 in the same kernel), and
SiLU-and-multiply. Each replaces a handful of small torch
kernels per layer (about 1,000 launches per decode step on an 8B model) and rounds to the model
dtype where the torch reference in layers.py rounds, so the two paths agree within an ulp.

On CUDA they are Triton kernels; on the CPU (float32) they are the compiled operators of
``attention/csrc/fused_ops_cpu.cpp`` (a one-sequence decode step spent about a third of its time outside
the matmuls in these small operators); SiLU-and-multiply stays PyTorch's there.
``TALLYSERVE_FUSED_KERNELS=0`` turns both off; under ``TRITON_INTERPRET=1`` CPU tensors run the Triton kernels in the interpreter (their tests).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from tallyserve.models import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None


_INTERPRET = pdl.INTERPRET


def _interpret() -> bool:
    return _INTERPRET


def available(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """Fused kernels run on CUDA with triton and on the CPU in float32 with the compiled CPU operators,
    unless TALLYSERVE_FUSED_KERNELS=0."""
    if os.environ.get("TALLYSERVE_FUSED_KERNELS", "1") == "0":
        return False
    if device.type == "cuda" or _interpret():
        return triton is not None
    if device.type == "cpu" and dtype in (None, torch.float32):
        from tallyserve.attention import cpu_kernels

        return cpu_kernels.load() and hasattr(torch.ops.tallyserve_cpu, "add_rms_norm")
    return False


def _on_cpu(x: torch.Tensor) -> bool:
    return not _INTERPRET and x.device.type == "cpu"


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # residual <- x + residual, rounded to the model dtype as torch's add does
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0)
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + offs, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rotary_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_c, eps,
                               NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        # One (token, head) of q or k: RMSNorm over the head (q's or k's weight), rounded to the
        # model dtype as the torch RMSNorm rounds, then the rotary embedding, in place.
        pdl.enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        w_ptr = qw_ptr if h < NUM_Q_HEADS else kw_ptr
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        dt = x_ptr.dtype.element_ty
        y1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0)
        s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0)
        tl.store(base + offs, (y1 * c - y2 * s).to(dt), mask=mask)
        tl.store(base + HALF + offs, (y2 * c + y1 * s).to(dt), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMSNorm of (x + residual) over the last dim; `residual` (if given) is updated in place to
    x + residual. x and residual: contiguous (T, N). ``out_dtype=torch.bfloat16`` on the CPU (the input of a
    bfloat16 matmul, dtype="bfloat16"): x float32 or bfloat16, the residual and the arithmetic float32, the
    result rounded once to bfloat16."""
    if _on_cpu(x):
        if out_dtype == torch.bfloat16:
            return torch.ops.tallyserve_cpu.add_rms_norm_bf16(x, residual, weight, eps)
        return torch.ops.tallyserve_cpu.add_rms_norm(x, residual, weight, eps)
    n = x.shape[-1]
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x.shape[0],)](x, residual if residual is not None else x, weight, out, n, eps,
                                        HAS_RESIDUAL=residual is not None, BLOCK=block,
                                        num_warps=4 if block <= 4096 else 8, **pdl.launch_options(x.device))
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x (T, H, D) in place, rotate-half layout; cos/sin (T, D) float32 (halves equal)."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("rotary_ needs a contiguous last dimension")
    if _on_cpu(x):
        torch.ops.tallyserve_cpu.rotary_(x, cos, sin)
        return
    half = dim // 2
    _rotary_kernel[(tokens, heads)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                    HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
                                    **pdl.launch_options(x.device))


def qk_norm_rotary_(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Per-head RMSNorm (q_weight on the first `num_q_heads` heads, k_weight on the rest) then the
    rotary embedding, in place, in one kernel: qk (T, Hq + Hkv, D) with a contiguous last dim, as q
    and k sit side by side in the fused qkv projection; cos/sin (T, D) float32."""
    tokens, heads, dim = qk.shape
    if qk.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("qk_norm_rotary_ needs a contiguous last dimension")
    if _on_cpu(qk):
        torch.ops.tallyserve_cpu.qk_norm_rotary_(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
        return
    half = dim // 2
    _qk_norm_rotary_kernel[(tokens, heads)](qk, q_weight, k_weight, cos, sin, qk.stride(0), qk.stride(1),
                                            cos.stride(0), eps, NUM_Q_HEADS=num_q_heads, HALF=half,
                                            BLOCK=triton.next_power_of_2(half), num_warps=1,
                                            **pdl.launch_options(qk.device))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (T, 2N) contiguous; returns (T, N)."""
    if _on_cpu(gate_up):  # PyTorch's vectorized SiLU beat a compiled loop at every size measured (float32)
        if gate_up.dtype == torch.bfloat16:  # float32 arithmetic, one rounding (two PyTorch ops round twice)
            return torch.ops.tallyserve_cpu.silu_mul_bf16(gate_up)
        n = gate_up.shape[1] // 2
        return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    tokens, width = gate_up.shape
    n = width // 2
    out = gate_up.new_empty((tokens, n))
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out
