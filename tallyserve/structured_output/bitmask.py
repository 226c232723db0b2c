"""Token bitmasks on the device: what the sampler applies to a step's logits.

A bitmask row is ceil(vocab / 32) int32 words; bit ``t % 32`` of word ``t // 32`` set means token
``t`` is allowed. The engine fills one host tensor per step for the rows that need it (rows of
requests with a grammar, one per sampled position: the last token and each draft) and ships it
with the step; the runner uploads it without waiting and masks those logits rows in one batched
operation. Rows without a grammar are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from tallyserve.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class GrammarBitmask:
    """The bitmask rows of one step: for each request id in ``request_ids`` (in the step's order),
    ``num_sample_rows`` consecutive rows of ``bitmask`` (int32, host memory)."""

    request_ids: frozenset[str]
    bitmask: torch.Tensor  # (rows, ceil(vocab / 32)) int32


class HostBitmaskBuffers:
    """Reused host tensors for the steps' bitmask rows. Pinned (CUDA): the runner uploads a step's
    rows with one non-blocking copy straight from them. Two take turns, and each is refilled only
    after the device has read it (an event recorded once its step's sampling was queued), so a
    fill never races the previous step's upload. Without pinning a fresh tensor is made per step."""

    def __init__(self, num_words: int, pin_memory: bool) -> None:
        self.num_words = num_words
        self.pin_memory = pin_memory
        self._bufs: list[Optional[torch.Tensor]] = [None, None]
        self._events: list[Optional[object]] = [None, None]
        self._turn = 0

    def take(self, rows: int) -> torch.Tensor:
        """A (rows, num_words) int32 host tensor whose every row the caller fills."""
        if not self.pin_memory:
            return torch.empty((rows, self.num_words), dtype=torch.int32)
        self._turn ^= 1
        event, self._events[self._turn] = self._events[self._turn], None
        if event is not None:
            event.synchronize()  # the device read this buffer two steps ago: almost never a wait
        buf = self._bufs[self._turn]
        if buf is None or buf.shape[0] < rows:
            size = max(rows, 2 * buf.shape[0] if buf is not None else 64)
            buf = self._bufs[self._turn] = torch.empty((size, self.num_words), dtype=torch.int32, pin_memory=True)
        return buf[:rows]

    def uploaded(self) -> None:
        """The step that reads the buffer last taken is queued: mark where the device is done with it."""
        if self.pin_memory and self._bufs[self._turn] is not None:
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event


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
    from tallyserve.runner.sampler import host_tensor

    rows = logits_rows(so, gb.request_ids)
    if len(rows) != gb.bitmask.shape[0]:
        raise ValueError(f"grammar bitmask has {gb.bitmask.shape[0]} rows for {len(rows)} logits rows")
    if raw is not None and logits is raw:
        logits = logits.clone()
    index = host_tensor(rows, logits.device)
    from tallyserve.kernels import logits_mask as bitmask_kernel

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
    from tallyserve.runner.sampler import host_tensor

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
