"""One-row projections on CUDA: a Triton GEMV for the batch-1 decode step.

A decode step of one sequence is ~130 matrix-vector products that each stream one weight matrix from
HBM. cuBLAS runs them at 2.5-4.1 TB/s on an H200 (the small ones lose most to ramp-up and tail, and
some split K and add a reduce kernel); this kernel streams the same weights at 3.1-4.3 TB/s (Llama-3-8B's
four per-layer shapes, 32 distinct copies so nothing stays in L2; the card reads at 4.58 TB/s). Each
program owns ``BLOCK_N`` output features and walks K in tiles, accumulating in float32, and stores
one rounded output: the result is the exact dot product rounded once, like cuBLAS's, with another
summation order.

Two things cut the gaps between kernels:
  * ``silu_mul_input``: the MLP's down projection reads ``[gate | up]`` and applies SiLU-and-multiply
    while loading its input (rounded where ``fused_ops.silu_mul`` rounds), one kernel fewer per layer.
  * Programmatic dependent launch (Hopper and later, ``kernels/pdl.py``): the GEMV is launched as a
    dependent of the kernel before it, loads its first weight tile (weights never depend on an earlier
    kernel), and only then waits for that kernel before reading its input. The other Triton kernels of
    the step are dependent launches too and signal the next kernel as they start, so the weight stream
    starts while the small kernel before the projection still runs.

``TALLYSERVE_TRITON_GEMV=0`` turns the kernel off (cuBLAS everywhere); ``TALLYSERVE_PDL=0`` keeps
it but launches without the dependency overlap. Under ``TRITON_INTERPRET=1`` CPU tensors run it in
the interpreter (its tests).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from tallyserve.kernels import pdl
from tallyserve import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

_DTYPES = (torch.bfloat16, torch.float16)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves ``x @ weight.T``: one row, a contiguous half-precision weight of x's dtype,
    on CUDA (or under the interpreter), and TALLYSERVE_TRITON_GEMV not 0."""
    if not (x.is_cuda or pdl.INTERPRET) or triton is None or x.dim() != 2 or x.shape[0] != 1:
        return False  # (the device first: every CPU projection asks)
    if weight.dtype != x.dtype or x.dtype not in _DTYPES:
        return False
    if not weight.is_contiguous() or not envs.TALLYSERVE_TRITON_GEMV:
        return False
    return True


def usable_fp8(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves one row of half-precision x against an FP8 e4m3 weight (with its scales)."""
    if not (x.is_cuda or pdl.INTERPRET) or triton is None or x.dim() != 2 or x.shape[0] != 1:
        return False
    return weight.dtype == torch.float8_e4m3fn and x.dtype in _DTYPES and weight.is_contiguous() and \
        envs.TALLYSERVE_TRITON_GEMV


def _overrides() -> dict[tuple[int, int], tuple[int, int, int]]:
    """``TALLYSERVE_GEMV_TILES="4096x12288=8,512,4;..."``: (BLOCK_N, BLOCK_K, num_warps) for exact (N, K)
    shapes, for A/B runs of tile choices; anything unparsable is an error (a typo must not pass silently)."""
    return _parse_tiles(envs.TALLYSERVE_GEMV_TILES)


@functools.lru_cache(maxsize=8)
def _parse_tiles(spec: str) -> dict[tuple[int, int], tuple[int, int, int]]:
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            shape, tiles = item.split("=")
            n, k = (int(v) for v in shape.lower().split("x"))
            bn, bk, w = (int(v) for v in tiles.split(","))
        except ValueError:
            raise ValueError(f"TALLYSERVE_GEMV_TILES: cannot parse {item!r} (want NxK=BLOCK_N,BLOCK_K,WARPS)") from None
        out[(n, k)] = (bn, bk, w)
    return out


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from sweeps on an H200 over the presets' shapes (bf16, one row): wide
    outputs (gate/up) take 16 x 256 tiles, Qwen3-8B's 24576 x 4096 16 x 512 (4.37 TB/s against 4.29); long rows
    (down) 8 x 1024 up to 4096 outputs (Llama-3-8B 4.03 TB/s,
    Qwen3-8B 3.94) and 8 x 512 beyond (Mistral-Nemo's 5120 x 14336: 3.86 TB/s, 3.39 with 8 x 1024); 4096 x 4096
    8 x 1024; the rest 8 x 512."""
    forced = _overrides().get((n, k))
    if forced is not None:
        return forced[0], min(forced[1], triton.next_power_of_2(k)), forced[2]
    if (n, k) == (24576, 4096):
        block_n, block_k = 16, 512
    elif n >= 16384:
        block_n, block_k = 16, 256
    elif k >= 8192:
        block_n, block_k = 8, 1024 if n <= 4096 else 512
    elif n <= 4096:
        block_n, block_k = 8, 1024
    else:
        block_n, block_k = 8, 512
    return block_n, min(block_k, triton.next_power_of_2(k)), 4


if triton is not None:

    @triton.jit
    def _load_input(x_ptr, k0, offs_k, K, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
        kk = k0 + offs_k
        kmask = kk < K
        if SILU_MUL:  # x = [gate | up] (2K,): silu(gate) * up, rounded as fused_ops.silu_mul rounds
            if EVEN_K:
                g = tl.load(x_ptr + kk).to(tl.float32)
                u = tl.load(x_ptr + K + kk).to(tl.float32)
            else:
                g = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
                u = tl.load(x_ptr + K + kk, mask=kmask, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
            return (act * u).to(x_ptr.dtype.element_ty).to(tl.float32)
        if EVEN_K:
            return tl.load(x_ptr + kk).to(tl.float32)
        return tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, s_ptr, N, K, stride_wn, stride_sn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     SILU_MUL: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr = 0,
                     SCALE_BN: tl.constexpr = 1, SCALE_BK: tl.constexpr = 1):
        pdl.launch_dependents(PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        # the first weight tile before the wait: the weights never depend on the kernel before this one
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        pdl.wait(PDL)
        x = _load_input(x_ptr, 0, offs_k, K, SILU_MUL=SILU_MUL, EVEN_K=EVEN_K)
        wf = w.to(tl.float32)
        if SCALE == 2:  # FP8 weight, one scale per (SCALE_BN, SCALE_BK) block; a K tile lies in one block
            s_ptrs = s_ptr + (offs_n // SCALE_BN) * stride_sn
            wf = wf * tl.load(s_ptrs, mask=n_ok, other=0.0)[:, None]
        acc = wf * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & (k0 + offs_k[None, :] < K), other=0.0)
            x = _load_input(x_ptr, k0, offs_k, K, SILU_MUL=SILU_MUL, EVEN_K=EVEN_K)
            wf = w.to(tl.float32)
            if SCALE == 2:
                wf = wf * tl.load(s_ptrs + k0 // SCALE_BK, mask=n_ok, other=0.0)[:, None]
            acc += wf * x[None, :]
        out = tl.sum(acc, axis=1)
        if SCALE == 1:  # FP8 weight, one scale per output row
            out = out * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
         silu_mul_input: bool = False, scale: Optional[torch.Tensor] = None,
         scale_block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``x @ weight.T`` for one row x (1, K) and weight (N, K); with ``silu_mul_input`` x is
    ``[gate | up]`` (1, 2K) and the product is ``silu_mul(x) @ weight.T``. Returns (1, N) in
    ``out_dtype`` (default x's dtype). An FP8 weight comes with its float32 ``scale``: (N,) per row, or
    (ceil(N / bn), ceil(K / bk)) per ``scale_block`` (bn, bk)."""
    n, k = weight.shape
    width = 2 * k if silu_mul_input else k
    if x.shape != (1, width):
        raise ValueError(f"gemv needs x of shape (1, {width}) for a ({n}, {k}) weight, got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, warps = _config(n, k)
    mode, sbn, sbk, stride_sn = 0, 1, 1, 0
    if scale is not None:
        mode = 1 if scale_block is None else 2
        if scale_block is not None:
            sbn, sbk = scale_block
            stride_sn = scale.stride(0)
            block_k = min(block_k, sbk)
            if sbk % block_k:
                raise ValueError(f"gemv: scale blocks of {sbk} columns are not whole tiles of {block_k}")
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, scale if scale is not None else out, n, k, weight.stride(0), stride_sn, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, SILU_MUL=silu_mul_input, SCALE=mode, SCALE_BN=sbn, SCALE_BK=sbk,
        num_warps=warps, **pdl.launch_options(x.device))
    return out
