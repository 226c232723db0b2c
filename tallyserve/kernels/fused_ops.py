"""Fused kernels for the forward pass: residual add + RMSNorm, in-place rotary
embedding of q and k together (with the per-head q/k RMSNorm of Qwen3 in the same kernel), and
SiLU-and-multiply. Each replaces a handful of small torch
kernels per layer (about 1,000 launches per decode step on an 8B model) and rounds to the model
dtype where the torch reference in layers.py rounds, so the two paths agree within an ulp.

On CUDA they are Triton kernels; on the CPU (float32) they are the compiled operators of
``kernels/csrc/fused_ops_cpu.cpp`` (a one-sequence decode step spent about a third of its time outside
the matmuls in these small operators); SiLU-and-multiply stays PyTorch's there.
``TALLYSERVE_FUSED_KERNELS=0`` turns both off; under ``TRITON_INTERPRET=1`` CPU tensors run the Triton kernels in the
interpreter (their tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from tallyserve.kernels import pdl
from tallyserve import envs
from tallyserve.kernels import cpu_kernels

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
    if not envs.TALLYSERVE_FUSED_KERNELS:
        return False
    if device.type == "cuda" or _interpret():
        return triton is not None
    if device.type == "cpu" and dtype in (None, torch.float32):
        return cpu_kernels.load() and hasattr(torch.ops.tallyserve_cpu, "add_rms_norm")
    return False


def _on_cpu(x: torch.Tensor) -> bool:
    return not _INTERPRET and x.device.type == "cpu"


# The CPU operators' arguments, checked before the call: a bad one is a ValueError here, never the operator's own
# TORCH_CHECK (an exception from a compiled kernel ends the process on some hosts, see kernels/cpu_kernels.py).
# A few attribute reads per call (about a microsecond).
_F32 = torch.float32


def _check_norm_args(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bf16_out: bool) -> None:
    if not (x.dtype == _F32 or (bf16_out and x.dtype == torch.bfloat16)) or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"add_rms_norm on the CPU: x must be a contiguous float32 (T, N){' or bfloat16' * bf16_out}; "
                         f"got {x.dtype} {tuple(x.shape)}")
    if weight.dtype != _F32 or weight.numel() != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm on the CPU: weight must be a contiguous float32 ({x.shape[1]},); "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if residual is not None and (residual.dtype != _F32 or residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"add_rms_norm on the CPU: the residual must be a contiguous float32 tensor shaped as x "
                         f"{tuple(x.shape)}; got {residual.dtype} {tuple(residual.shape)}")


def _check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x (T, H, D) with a contiguous last dimension (the callers check the strides), cos/sin (T, D)."""
    tokens, _, dim = x.shape
    if x.dtype != _F32 or dim % 2:
        raise ValueError(f"rotary on the CPU: x must be float32 (T, H, D) with an even D; got {x.dtype} "
                         f"{tuple(x.shape)}")
    if (cos.dtype != _F32 or sin.dtype != _F32 or cos.shape != (tokens, dim) or sin.shape != cos.shape
            or sin.stride() != cos.stride()):
        raise ValueError(f"rotary on the CPU: cos and sin must be float32 ({tokens}, {dim}) with the same strides; "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")


def fuses_kv_write(qkv: torch.Tensor) -> bool:
    """Whether ``rotary_write_kv_`` runs for ``qkv`` (the Triton kernels: CUDA, or the interpreter; elsewhere
    the attention backend writes the KV rows itself)."""
    return triton is not None and not _on_cpu(qkv) and qkv.is_contiguous()


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
    def _rotary_write_kv_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                                stride_t, stride_h, stride_c, stride_kv, stride_cb, stride_co, stride_ch, eps,
                                inv_k_scale, inv_v_scale, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, QK_NORM: tl.constexpr,
                                PDL: tl.constexpr):
        # HEADS heads of one token's fused q/k/v row: q and k heads get the rotary embedding in place (after
        # Qwen3's per-head RMSNorm with QK_NORM), k and v heads are also stored at the token's cache slot
        # (none for a negative slot). Values round as the separate kernels round: to the model dtype, then
        # to the cache's. K and V of the cache are one tensor, V ``stride_kv`` elements after K.
        pdl.enter(PDL)
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        offs = tl.arange(0, BLOCK)
        num_heads = NUM_Q_HEADS + 2 * NUM_KV_HEADS
        mask = (head[:, None] < num_heads) & (offs[None, :] < HALF)
        ptrs = x_ptr + t * stride_t + head[:, None] * stride_h + offs[None, :]
        dt = x_ptr.dtype.element_ty
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
        rotate = head < NUM_Q_HEADS + NUM_KV_HEADS  # q and k heads; the rest are v heads
        y1 = x1.to(tl.float32)
        y2 = x2.to(tl.float32)
        if QK_NORM:
            inv = tl.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / (2 * HALF) + eps)
            is_q = (head < NUM_Q_HEADS)[:, None]
            qw1 = tl.load(qw_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            qw2 = tl.load(qw_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            kw1 = tl.load(kw_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            kw2 = tl.load(kw_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
            y1 = (tl.where(is_q, qw1, kw1) * (y1 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            y2 = (tl.where(is_q, qw2, kw2) * (y2 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_c + offs, mask=offs < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * stride_c + offs, mask=offs < HALF, other=0.0)[None, :]
        x1 = tl.where(rotate[:, None], (y1 * c - y2 * s).to(dt), x1)
        x2 = tl.where(rotate[:, None], (y2 * c + y1 * s).to(dt), x2)
        keep = mask & rotate[:, None]
        tl.store(ptrs, x1, mask=keep)
        tl.store(ptrs + HALF, x2, mask=keep)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        is_v = head >= NUM_Q_HEADS + NUM_KV_HEADS
        kv_head = tl.where(is_v, head - NUM_Q_HEADS - NUM_KV_HEADS, head - NUM_Q_HEADS)
        safe = tl.where(slot >= 0, slot, 0)
        dst = (cache_ptr + is_v.to(tl.int64) * stride_kv + (safe // BLOCK_SIZE) * stride_cb
               + (safe % BLOCK_SIZE) * stride_co + kv_head * stride_ch)
        # k and v heads of a real row; a padding row (slot < 0) writes none (the slot test folds into the bound:
        # a block & a scalar bool trips Triton 3.9's interpreter)
        write = mask & (head[:, None] >= tl.where(slot >= 0, NUM_Q_HEADS, num_heads))
        ct = cache_ptr.dtype.element_ty
        if ct == tl.float8e4nv:  # kv_cache_dtype="fp8": k / k_scale, v / v_scale (of the model-dtype values), saturated
            inv = tl.where(is_v, inv_v_scale, inv_k_scale)[:, None]
            tl.store(dst[:, None] + offs[None, :], tl.clamp(x1.to(tl.float32) * inv, -448.0, 448.0).to(ct), mask=write)
            tl.store(dst[:, None] + HALF + offs[None, :], tl.clamp(x2.to(tl.float32) * inv, -448.0, 448.0).to(ct),
                     mask=write)
        else:
            tl.store(dst[:, None] + offs[None, :], x1.to(ct), mask=write)
            tl.store(dst[:, None] + HALF + offs[None, :], x2.to(ct), mask=write)

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
        _check_norm_args(x, residual, weight, out_dtype == torch.bfloat16)
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
        _check_rope_args(x, cos, sin)
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
        _check_rope_args(qk, cos, sin)
        if not 0 < num_q_heads < heads or any(w.dtype != _F32 or w.numel() != dim for w in (q_weight, k_weight)):
            raise ValueError(f"qk_norm_rotary_ on the CPU: float32 q/k norm weights of {dim} and 0 < num_q_heads "
                             f"({num_q_heads}) < {heads} heads")
        torch.ops.tallyserve_cpu.qk_norm_rotary_(qk, q_weight, k_weight, num_q_heads, eps, cos, sin)
        return
    half = dim // 2
    _qk_norm_rotary_kernel[(tokens, heads)](qk, q_weight, k_weight, cos, sin, qk.stride(0), qk.stride(1),
                                            cos.stride(0), eps, NUM_Q_HEADS=num_q_heads, HALF=half,
                                            BLOCK=triton.next_power_of_2(half), num_warps=1,
                                            **pdl.launch_options(qk.device))


def rotary_write_kv_(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, q_weight: Optional[torch.Tensor] = None,
                     k_weight: Optional[torch.Tensor] = None, eps: float = 0.0,
                     kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """The rotary embedding of q and k in place (after the per-head q/k RMSNorm when ``q_weight`` and
    ``k_weight`` are given) and the write of k and v into ``kv_cache`` at ``slot_mapping`` (slots < 0:
    padding, not written), in one kernel: what ``rotary_`` / ``qk_norm_rotary_`` and the attention
    backend's KV write do, with the same roundings. ``qkv`` (T, Hq + 2 * Hkv, D): the fused projection's
    output with a contiguous last dim; ``kv_cache`` (2, num_blocks, block_size, Hkv, D); an FP8 cache stores
    k / k_scale and v / v_scale (``kv_scale``). CUDA (and the interpreter) only."""
    tokens, heads, dim = qkv.shape
    if qkv.stride(2) != 1 or cos.stride(1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("rotary_write_kv_ needs contiguous last dimensions")
    if heads != num_q_heads + 2 * num_kv_heads or tuple(kv_cache.shape[3:]) != (num_kv_heads, dim):
        raise ValueError(f"qkv {tuple(qkv.shape)} and kv_cache {tuple(kv_cache.shape)} do not match "
                         f"{num_q_heads} query and {num_kv_heads} KV heads")
    if slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows for {tokens} tokens")
    if tokens == 0:
        return
    qk_norm = q_weight is not None
    k_cache = kv_cache[0]
    half = dim // 2
    per_prog = min(16, triton.next_power_of_2(heads))  # heads per program: one token's q/k/v in a few programs
    _rotary_write_kv_kernel[(tokens, triton.cdiv(heads, per_prog))](
        qkv, q_weight if qk_norm else cos, k_weight if qk_norm else cos, cos, sin, kv_cache, slot_mapping,
        qkv.stride(0), qkv.stride(1), cos.stride(0), kv_cache.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), eps, 1.0 / kv_scale[0], 1.0 / kv_scale[1], NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=kv_cache.shape[2],
        HALF=half, BLOCK=triton.next_power_of_2(half), HEADS=per_prog, QK_NORM=qk_norm,
        num_warps=4 if per_prog * half >= 1024 else 2, **pdl.launch_options(qkv.device))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] (T, 2N) contiguous; returns (T, N)."""
    if _on_cpu(gate_up):  # PyTorch's vectorized SiLU beat a compiled loop at every size measured (float32)
        if gate_up.dtype == torch.bfloat16:  # float32 arithmetic, one rounding (two PyTorch ops round twice)
            if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
                raise ValueError(f"silu_mul on the CPU: gate_up must be contiguous (T, 2N); got {tuple(gate_up.shape)}")
            return torch.ops.tallyserve_cpu.silu_mul_bf16(gate_up)
        n = gate_up.shape[1] // 2
        return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    tokens, width = gate_up.shape
    n = width // 2
    out = gate_up.new_empty((tokens, n))
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out
