"""Host buffers for the grammar bitmask rows the StructuredOutputManager fills each step.

A bitmask row is ceil(vocab / 32) int32 words; bit ``t % 32`` of word ``t // 32`` set means token
``t`` is allowed. The manager fills one host tensor per step for the rows that need it (rows of
requests with a grammar, one per sampled position: the last token and each draft) and ships it with
the step as a ``GrammarBitmask`` (core/sched_output.py); the runner masks those logits rows
(runner/grammar_mask.py). Rows without a grammar are not touched.
"""

from __future__ import annotations

from typing import Optional

import torch


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
