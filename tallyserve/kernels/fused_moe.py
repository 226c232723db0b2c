"""The mixture-of-experts layer on CUDA in two grouped GEMM launches (vLLM's fused_moe is the reference design;
this is tallyserve's own code).

``align`` sorts the (token, k) pairs of a step by expert and pads each expert's run to whole tiles of BLOCK_M rows:
``sorted_pairs`` (pair ids, padding = the pair count) and ``tile_expert`` (the expert of each tile, E for tiles past
the end). Every size is an upper bound known from (tokens, top_k, experts, BLOCK_M) alone, so nothing is read back
to the host and a decode step can be captured in a CUDA graph.

``_moe_gemm_kernel`` then computes, for each tile, ``C[pair] = A[row(pair)] @ W[expert]^T`` over the tile's rows:
the gate/up product reads x by token (row = pair // top_k), the down product reads the SiLU-and-multiplied
intermediate by pair and multiplies each row by its routing weight. The k rows of a token are summed at the end.
Under ``TRITON_INTERPRET=1`` CPU tensors run the same kernels (the unit tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from tallyserve.kernels import fused_ops, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs (P + E (BLOCK_M - 1),), tile_expert (tiles,)) for ``topk_ids`` (T, k) with values in [0, E);
    see the module doc. No host synchronisation (counts by scatter_add, not bincount, whose size is data-dependent)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    capacity = pairs + num_experts * (block_m - 1)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[(ends - padded)[expert_of] + rank] = order
    tiles = -(-capacity // block_m)
    first_row = torch.arange(tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(ends, first_row, right=True)  # num_experts past the last expert's tiles
    return sorted_pairs, tile_expert


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ptr, tile_expert_ptr, weight_ptr, num_pairs, num_experts,
                         N, K, stride_am, stride_we, stride_wn, stride_cm,
                         TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        if expert < num_experts:
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_ptr + offs_m)
            valid = pair < num_pairs
            if A_BY_TOKEN:
                row = pair // TOP_K
            else:
                row = pair
            row = tl.where(valid, row, 0).to(tl.int64)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            n_ok = offs_n < N
            a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
            w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc += tl.dot(a, w, input_precision=PREC)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            if MUL_WEIGHT:
                acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
            c_ptrs = c_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, tile_expert: torch.Tensor, num_pairs: int,
          top_k: int, by_token: bool, weights: Optional[torch.Tensor], block_m: int, zero: bool = False) -> torch.Tensor:
    """C (pairs, N): row p = A[row(p)] @ W[expert(p)]^T (times weight p); rows of pairs routed to no expert here
    are left unwritten (zero with ``zero``)."""
    num_experts, n, k = w.shape
    out = (torch.zeros if zero else torch.empty)((num_pairs, n), dtype=a.dtype, device=a.device)
    fp32 = a.dtype == torch.float32
    block_n = 32 if fp32 else 64
    block_k = 32 if fp32 else 64
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, w, out, sorted_pairs, tile_expert, weights if weights is not None else out,
                           num_pairs, num_experts, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           TOP_K=top_k, A_BY_TOKEN=by_token, MUL_WEIGHT=weights is not None, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_K=block_k, PREC="ieee" if fp32 else "tf32",
                           num_warps=4)
    return out


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: small tiles when each expert gets few rows (decode), larger ones for prompts."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def available(x: torch.Tensor) -> bool:
    """Whether ``fused_moe`` runs for x: CUDA (or the interpreter, for tests) with Triton."""
    return triton is not None and (x.is_cuda or pdl.INTERPRET)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, num_global_experts: Optional[int] = None) -> torch.Tensor:
    """sum over k of weights[t, k] x down(silu(gate) * up)(x[t]) with expert topk_ids[t, k]: x (T, H), w13 (E, 2I,
    H) (gate rows, then up rows), w2 (E, H, I), weights / topk_ids (T, k). Returns (T, H) in x's dtype. Under expert
    parallelism this rank holds experts [expert_start, expert_start + E) of ``num_global_experts``: pairs routed
    elsewhere add nothing."""
    t, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if t == 0:
        return torch.zeros_like(x)
    pairs = t * top_k
    local = topk_ids.to(torch.int64) - expert_start
    partial = num_global_experts is not None and num_global_experts != num_experts
    if partial:  # another rank's experts: a sentinel expert whose tiles are skipped
        local = torch.where((local < 0) | (local >= num_experts), num_experts, local)
    block_m = block_m_for(pairs, num_experts)
    sorted_pairs, tile_expert = align(local, num_experts + 1 if partial else num_experts, block_m)
    x = x.contiguous()
    gate_up = _gemm(x, w13, sorted_pairs, tile_expert, pairs, top_k, True, None, block_m)
    act = fused_ops.silu_mul(gate_up)
    down = _gemm(act, w2, sorted_pairs, tile_expert, pairs, top_k, False, weights.reshape(-1).contiguous(),
                 block_m, zero=partial)
    return down.view(t, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
