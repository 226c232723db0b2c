"""Triton kernel that scatters new K/V rows into the paged cache by flat slot.

Reference: ``torch_ref.write_kv_cache`` (same contract): row t of k/v (T, Hkv, D) goes to slot
``slot_mapping[t]`` (``block_id * block_size + offset``) of ``kv_cache`` (2, num_blocks,
block_size, Hkv, D); rows whose slot is negative (padding) are skipped, so they write nothing.

The slot is read on the device and the grid depends only on T, so the launch is CUDA-graph safe.
Works with Triton 3.6 and later, and under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tallyserve.kernels import pdl

# Elements of one (Hkv * D) row a program copies; a wider row is split over grid axis 1.
_MAX_ROW_BLOCK = 2048


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # (a block & a scalar bool trips Triton 3.9's interpreter, so fold the slot test into the bound)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    block = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    dst = block * stride_cb + (slot % BLOCK_SIZE) * stride_co + head * stride_ch + dim
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # kv_cache_dtype="fp8": k / k_scale, v / v_scale, saturated
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
    """Scatter k/v (T, Hkv, D) into ``kv_cache`` at ``slot_mapping`` (T,); slots < 0 are skipped. An FP8 cache
    stores k / k_scale and v / v_scale (``kv_scale``), rounded to e4m3 and saturated."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k_cache.stride(-1) != 1:
        raise ValueError("kv_cache must have a contiguous last (head_dim) dimension")
    row = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(row), _MAX_ROW_BLOCK)
    grid = (num_tokens, triton.cdiv(row, block))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / kv_scale[0], 1.0 / kv_scale[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, ROW=row, BLOCK=block,
        num_warps=4 if block >= 512 else 1, **pdl.launch_options(k.device),
    )
