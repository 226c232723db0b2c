"""Prompt-lookup (n-gram) drafts: no extra model. Propose the tokens that followed the most
recent earlier occurrence of the context's last n tokens (longest n first)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, n_min: int = 1, n_max: int = 3) -> None:
        self.k = num_speculative_tokens
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, token_ids: list[int]) -> list[int]:
        length = len(token_ids)
        if length < 2:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = arr[length - n:]
            windows = sliding_window_view(arr[: length - 1], n)  # earlier windows, each followed by a token
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + self.k].tolist()
        return []
