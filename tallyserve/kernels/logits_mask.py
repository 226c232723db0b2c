"""The grammar bitmask applied in one kernel: Triton on a CUDA device, a compiled operator on the CPU.

``mask_logits_rows_(logits, words, rows)``: for each k, logits row ``rows[k]`` gets -inf wherever bit
``t % 32`` of ``words[k, t // 32]`` is clear (tokens past the words' width are masked too). It replaces the
index_select / unpack / masked_fill / index_copy chain (about ten operators, ~0.6 ms of host time per
step at 256 rows): structured steps on a GPU are bound by host time, which this is part of. On the CPU
the same job is ``torch.ops.tallyserve_cpu.mask_logits_rows_`` (``kernels/csrc/fused_ops_cpu.cpp``):
xgrammar's CPU masking unpacks the words with tensor operators, 15 ms per step of 64 rows over a
49k vocabulary, against well under one millisecond.
"""

from __future__ import annotations

import os

import torch

from tallyserve import envs
from tallyserve.kernels import cpu_kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton use the torch path
    triton = None

_BLOCK = 2048


def available(logits: torch.Tensor) -> bool:
    if not envs.TALLYSERVE_FUSED_KERNELS:
        return False
    if logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return logits.dtype == torch.float32 and _cpu_kernels()
    if triton is None:
        return False
    return logits.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _cpu_kernels() -> bool:
    return cpu_kernels.load()


if triton is not None:

    @triton.jit
    def _mask_rows_kernel(logits_ptr, words_ptr, rows_ptr, vocab, num_words, logits_stride, words_stride,
                          BLOCK: tl.constexpr):
        k = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        row = tl.load(rows_ptr + k).to(tl.int64)
        in_vocab = offs < vocab
        word_idx = offs // 32
        words = tl.load(words_ptr + k * words_stride + word_idx, mask=in_vocab & (word_idx < num_words), other=0)
        allowed = (words >> (offs % 32)) & 1
        tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=in_vocab & (allowed == 0))


def mask_logits_rows_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place on ``logits`` (rows, vocab), float, last dim contiguous; ``words`` (k, W) int32 on the
    same device, ``rows`` (k,) integer indices into ``logits``. Returns ``logits``."""
    if words.dtype != torch.int32 or words.dim() != 2 or words.stride(1) != 1:
        raise ValueError("words must be a 2-D int32 tensor with a contiguous last dimension")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be 2-D with a contiguous last dimension")
    if rows.dim() != 1 or rows.numel() != words.shape[0]:
        raise ValueError(f"one logits row index per bitmask row: {rows.numel()} indices, {words.shape[0]} rows")
    if rows.numel() == 0:
        return logits
    if logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # what the operator's checks refuse, as ValueError here (an error from a compiled kernel is unsafe on some
        # hosts, see kernels/cpu_kernels.py); one min/max of the indices
        if logits.dtype != torch.float32 or words.device.type != "cpu":
            raise ValueError("the CPU bitmask takes float32 logits and CPU words")

        lo, hi = cpu_kernels.int_bounds(rows)
        if lo < 0 or hi >= logits.shape[0]:
            raise ValueError(f"row index {lo if lo < 0 else hi} is outside the logits' {logits.shape[0]} rows")
        torch.ops.tallyserve_cpu.mask_logits_rows_(logits, words, rows)
        return logits
    vocab = logits.shape[1]
    grid = (rows.numel(), triton.cdiv(vocab, _BLOCK))
    _mask_rows_kernel[grid](logits, words, rows, vocab, words.shape[1], logits.stride(0), words.stride(0),
                            BLOCK=_BLOCK, num_warps=4)
    return logits
