"""The grammar bitmask applied to a step's logits: each grammar row's forbidden tokens set to -inf.

A bitmask row is ceil(vocab / 32) int32 words; bit ``t % 32`` of word ``t // 32`` set means token ``t`` is
allowed (``GrammarBitmask`` in core/sched_output.py carries a step's rows). On a CUDA device or the CPU one
kernel masks the rows in place (kernels/logits_mask.py); otherwise ``mask_rows``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from tallyserve.kernels import logits_mask as bitmask_kernel
from tallyserve.runner.host_tensors import host_tensor

if TYPE_CHECKING:
    from tallyserve.core.sched_output import GrammarBitmask, SchedulerOutput


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool: which tokens each row allows (works on any device)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift keeps bit 31 readable
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def logits_rows(so: "SchedulerOutput", request_ids: frozenset[str]) -> list[int]:
    """Rows of the step's logits (one per sampled position) that belong to ``request_ids``."""
    rows, row = [], 0
    for e in so.requests:
        n = e.num_sample_rows
        if n and e.request_id in request_ids:
            rows.extend(range(row, row + n))
        row += n
    return rows


def apply_grammar_bitmask(so: "SchedulerOutput", logits: torch.Tensor, raw: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """Mask (to -inf) the tokens each grammar row forbids; returns the logits to sample from.
    ``raw``: the unprocessed logits (kept for the reported logprobs): when ``logits`` is that very
    tensor it is copied first, so the logprobs stay those of the model."""
    gb: Optional[GrammarBitmask] = getattr(so, "grammar_bitmask", None)
    if gb is None or not gb.request_ids:
        return logits
    rows = logits_rows(so, gb.request_ids)
    if len(rows) != gb.bitmask.shape[0]:
        raise ValueError(f"grammar bitmask has {gb.bitmask.shape[0]} rows for {len(rows)} logits rows")
    if raw is not None and logits is raw:
        logits = logits.clone()
    index = host_tensor(rows, logits.device)
    if bitmask_kernel.available(logits):  # one kernel, in place on the grammar rows
        return bitmask_kernel.mask_logits_rows_(logits, _upload(gb.bitmask, logits.device), index)
    masked = mask_rows(logits.index_select(0, index), gb.bitmask)
    logits.index_copy_(0, index, masked)
    return logits


def _upload(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host words on ``device``: the engine's reused pinned buffer goes up without waiting."""
    device = torch.device(device)
    if device.type == "cpu" or bitmask.device.type != "cpu":
        return bitmask.to(device)
    if bitmask.is_pinned():
        return bitmask.to(device, non_blocking=True)
    return host_tensor(bitmask.numpy(), device, torch.int32)


def mask_rows(rows: torch.Tensor, bitmask: torch.Tensor, cpu_kernel: bool = True) -> torch.Tensor:
    """Set to -inf, in place, the logits each host bitmask row forbids (rows aligned; tokens past the
    words' width are forbidden too). On the CPU xgrammar's kernel does it; on a GPU the words are
    uploaded without waiting and unpacked there."""
    width = bitmask.shape[1] * 32
    if width < rows.shape[1]:
        rows[:, width:] = float("-inf")
        mask_rows(rows[:, :width], bitmask, cpu_kernel)
        return rows
    if rows.device.type == "cpu" and cpu_kernel:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(rows, bitmask, vocab_size=rows.shape[1])
        return rows
    words = _upload(bitmask, rows.device)
    return rows.masked_fill_(~allowed_from_bitmask(words, rows.shape[1]), float("-inf"))
