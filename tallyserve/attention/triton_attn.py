"""Triton paged attention: the GPU fast path of ``AttentionBackend``: tile sizes, split counts and
launches of the kernels in ``triton_kernels.py`` (which describes them).

Reference: ``torch_ref.paged_attention`` (the parity target; tests/unit/test_triton_interpret.py
runs these kernels under ``TRITON_INTERPRET=1`` against it, tests/gpu at full size). Every length is
read from device tensors; host values only pick tile sizes and grid bounds, so a decode step can be
captured in a CUDA graph (capture with ``max_seq_len`` set to the capture-time bound).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from tallyserve.attention.backend import FP8_KV_DTYPE, AttentionBackend, KVScale, check_attention_inputs
from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.kernels.kv_cache_write import write_kv_cache
from tallyserve.kernels import pdl
from tallyserve.kernels.paged_attention import (
    LOG2E, MAX_HEAD_DIM, cascade_prefix_kernel, decode_kernel, prefill_kernel, reduce_kernel,
)


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options; ``None`` fields are chosen from the shapes (see
    ``paged_attention``). benchmarks/h200_bench.py --only tune sweeps some of them."""

    block_n: Optional[int] = None  # keys per tile (both kernels unless decode_block_n is set)
    prefill_block_m: Optional[int] = None  # rows (query tokens x padded group) of a prefill tile
    decode_block_n: Optional[int] = None
    prefill_num_warps: Optional[int] = None
    prefill_num_stages: Optional[int] = None  # None: Triton's default
    decode_num_warps: int = 4
    decode_num_stages: Optional[int] = None
    # decode grid (KV heads, requests, splits): the programs running together read all KV heads of a few
    # requests (a cache row holds a token's heads side by side) rather than one head of many requests; 4%
    # more KV bandwidth at batch 256 on an H200, the same at 64 (benchmarks/decode_attention_bench.py)
    decode_heads_first: bool = True
    num_splits: Optional[int] = None  # decode split-K; None: fill the GPU (see _decode_splits)
    max_splits: int = 32
    min_split_len: int = 256  # fewer keys than this per split is not worth a split
    # cascade attention's shared-prefix kernel: query rows (request x head) per tile, keys per tile
    # (None: decode's), warps, stages, prefix split count (None: fill the GPU like decode's split-K)
    cascade_block_m: Optional[int] = None
    cascade_block_n: Optional[int] = None
    cascade_num_warps: int = 4
    cascade_num_stages: Optional[int] = None
    cascade_num_splits: Optional[int] = None
    cascade_min_split_len: int = 64
    cascade_max_splits: int = 16


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _decode_splits(cfg: KernelConfig, num_reqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Power-of-two split count so that about two programs per SM run, bounded by the context.
    ``num_reqs``: programs per KV head before splitting."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    want = triton.cdiv(2 * _sm_count(device), max(1, num_reqs * num_kv_heads))
    by_len = max(1, max_seq_len // cfg.min_split_len)
    splits = min(want, by_len, cfg.max_splits)
    return 1 << (max(1, splits).bit_length() - 1)  # round down to a power of two


def _common_args(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata):
    k_cache = kv_cache[0]
    return (k_cache, kv_cache[1], meta.block_tables, meta.query_start_loc, meta.seq_lens), (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    out: Optional[torch.Tensor] = None, config: KernelConfig = KernelConfig(), kv_scale: KVScale = (1.0, 1.0),
) -> torch.Tensor:
    """Causal paged attention of q (T, Hq, D) over the already written cache; (T, Hq, D) in q's
    dtype. ``out`` (optional) is written in full: request rows by the kernels, padding rows zeroed.
    An FP8 cache's K and V are converted to q's dtype as they load, times ``kv_scale``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"triton attention supports head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    num_reqs = meta.num_reqs
    if meta.num_tokens < num_tokens:
        out[meta.num_tokens:].zero_()
    if num_reqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    fp32 = q.dtype == torch.float32  # exact ("ieee") fp32 dots need far more registers: small tiles
    # defaults from benchmarks/h200_bench.py --only tune on an H200 (Llama-3-8B shapes, bf16)
    prefill_block_n = config.block_n or 32
    decode_block_n = config.decode_block_n or config.block_n or (32 if fp32 or d_pad > 128 else 64)
    prec = "ieee" if fp32 else "tf32"
    tensors, strides = _common_args(q, out, kv_cache, meta)
    block_size = kv_cache.shape[2]
    k_scale, v_scale = (float(kv_scale[0]), float(kv_scale[1])) if kv_cache.dtype == FP8_KV_DTYPE else (1.0, 1.0)
    qk_scale = scale * LOG2E * k_scale
    if meta.max_query_len > 1:
        g_pad = triton.next_power_of_2(group)
        block_m = config.prefill_block_m or (32 if fp32 else 128 if d_pad <= 128 else 64)
        want = triton.next_power_of_2(meta.max_query_len) * g_pad
        block_m = max(16, g_pad, min(block_m, want))
        block_q = block_m // g_pad
        grid = (num_tokens // block_q + num_reqs, num_kv_heads)
        prefill_kernel[grid](
            q, out, *tensors, num_reqs, num_reqs.bit_length(), qk_scale, v_scale, *strides,
            GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
            BLOCK_Q=block_q, BLOCK_N=prefill_block_n, SKIP_DECODE=True, PREC=prec,
            num_warps=config.prefill_num_warps or (8 if d_pad > 128 else 4),
            **_stages(config.prefill_num_stages),
        )
    if _has_decode_rows(meta):
        _launch_decode(q, out, tensors, strides, meta, qk_scale, v_scale, group, d_pad, decode_block_n, block_size,
                       prec, config)
    return out


def _stages(num_stages: Optional[int]) -> dict:
    return {} if num_stages is None else {"num_stages": num_stages}


_last_qsl: list = [None, False]  # one-entry cache: every layer of a step passes the same tuple


def _has_decode_rows(meta: AttentionMetadata) -> bool:
    if meta.max_query_len <= 1:
        return True
    qsl = meta.query_start_loc_cpu
    if _last_qsl[0] is not qsl:
        _last_qsl[:] = [qsl, any(qsl[i + 1] - qsl[i] == 1 for i in range(len(qsl) - 1))]
    return _last_qsl[1]


def _launch_decode(q, out, tensors, strides, meta, qk_scale, v_scale, group, d_pad, block_n, block_size, prec, config):
    num_reqs, num_kv_heads = meta.num_reqs, tensors[0].shape[2]
    num_q_heads = q.shape[1]
    cascade = meta.common_prefix_len > 0 and meta.max_query_len == 1
    # each request's own keys are split as if they were its whole context: under a CUDA graph the
    # host knows only bounds (max_seq_len for both parts), and an empty split costs next to nothing
    splits = _decode_splits(config, num_reqs, num_kv_heads, meta.max_seq_len, q.device)
    prefix_splits = block_m_prefix = 0
    if cascade:
        block_m_prefix = config.cascade_block_m or 64
        tiles = triton.cdiv(num_reqs * group, block_m_prefix)
        # a prefix program serves a whole tile of rows, so short splits still pay (64 keys: 16 requests
        # over 512 shared tokens ran 1.35x faster with 8 splits than with 2 on an H200)
        prefix_cfg = dataclasses.replace(config, num_splits=config.cascade_num_splits,
                                         min_split_len=config.cascade_min_split_len,
                                         max_splits=min(config.max_splits, config.cascade_max_splits))
        prefix_splits = _decode_splits(prefix_cfg, tiles, num_kv_heads, meta.common_prefix_len, q.device)
    num_slots = splits + prefix_splits
    block_m = max(16, triton.next_power_of_2(group))
    if num_slots > 1:
        part_o = torch.empty((num_reqs, num_q_heads, num_slots, d_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_reqs, num_q_heads, num_slots), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    prefix_len_t = meta.prefix_kv_lens if cascade else meta.seq_lens  # read only with CASCADE
    heads_first = config.decode_heads_first and num_reqs <= 65535  # a grid's second axis holds at most 65,535
    grid = (num_kv_heads, num_reqs, splits) if heads_first else (num_reqs, num_kv_heads, splits)
    decode_kernel[grid](
        q, out, part_o, part_lse, *tensors[:3], meta.query_start_loc, meta.seq_lens, prefix_len_t, qk_scale, v_scale,
        *strides, num_q_heads, splits, num_slots,
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=q.shape[2], D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT=num_slots > 1, CASCADE=cascade, PREC=prec, HEADS_FIRST=heads_first,
        num_warps=config.decode_num_warps, **pdl.launch_options(q.device),
        **_stages(config.decode_num_stages),
    )
    if cascade:
        # the shared prefix: row 0 of the block table names its blocks (the same in every row)
        cascade_prefix_kernel[(triton.cdiv(num_reqs * group, block_m_prefix), num_kv_heads, prefix_splits)](
            q, part_o, part_lse, *tensors[:3], meta.query_start_loc, meta.seq_lens, meta.prefix_kv_lens, qk_scale,
            v_scale, strides[0], strides[1], *strides[5:], num_reqs, num_q_heads, prefix_splits, num_slots, splits,
            GROUP=group, HEAD_DIM=q.shape[2], D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m_prefix,
            BLOCK_N=config.cascade_block_n or block_n, PREC=prec, num_warps=config.cascade_num_warps,
            **_stages(config.cascade_num_stages),
        )
    if num_slots > 1:
        reduce_kernel[(num_reqs, num_q_heads)](
            out, part_o, part_lse, meta.query_start_loc, strides[2], strides[3], num_q_heads, num_slots,
            HEAD_DIM=q.shape[2], D_PAD=d_pad, S_PAD=triton.next_power_of_2(max(num_slots, config.max_splits)),
            num_warps=1, **pdl.launch_options(q.device),
        )


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels for both halves: ``triton_cache.write_kv_cache`` then ``paged_attention``.
    Reads lengths only from device tensors, so decode steps can be captured in CUDA graphs."""

    name = "triton"
    supports_cuda_graph = True
    supports_external_kv_write = True
    supports_cascade = True  # reads AttentionMetadata.common_prefix_len / prefix_kv_lens

    def __init__(self, config: Optional[KernelConfig] = None) -> None:
        self.config = config if config is not None else KernelConfig()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = (1.0, 1.0),
    ) -> torch.Tensor:
        check_attention_inputs(q, k, v, kv_cache, meta)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return paged_attention(q, kv_cache, meta, scale, config=self.config, kv_scale=kv_scale)

    def forward_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, kv_scale: KVScale = (1.0, 1.0)) -> torch.Tensor:
        return paged_attention(q, kv_cache, meta, scale, config=self.config, kv_scale=kv_scale)
