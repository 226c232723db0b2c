"""AttentionMetadata: what every attention backend reads for one forward pass.

Built by runner/forward_batch.py from a SchedulerOutput. Token rows are laid out request by
request: request i owns query rows [query_start_loc[i], query_start_loc[i+1]), which are its
token positions [seq_lens[i] - query_len_i, seq_lens[i]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# Cascade attention (decode steps over a prefix every request shares): used from this many requests
# and this many shared tokens on; below, the per-request kernels read the prefix cheaply enough.
CASCADE_MIN_REQS = 8
CASCADE_MIN_PREFIX_TOKENS = 256


@dataclass(frozen=True)
class AttentionMetadata:
    # (T,) int64: flat cache slot (block_id * block_size + offset) each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # (B + 1,) int32: cumulative query lengths; query_start_loc[-1] == T.
    query_start_loc: torch.Tensor
    # (B,) int32: context length of each request after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # (B, max_blocks) int32: block ids of each request, padded with 0 (never read past seq_lens).
    block_tables: torch.Tensor
    # Host copies of the two length vectors, for Python-side loops without device syncs.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Cascade attention: the first ``common_prefix_len`` KV tokens of every request lie in the same
    # blocks (row 0 of block_tables names them), so a backend may attend them once for all requests
    # and merge. 0: no shared prefix. ``prefix_kv_lens`` (1,) int32 holds the same on the device (a
    # CUDA graph reads the length from it; its host field is then the capture-time bound).
    common_prefix_len: int = 0
    prefix_kv_lens: Optional[torch.Tensor] = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1] if self.query_start_loc_cpu else 0


def common_prefix_len(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """KV tokens at the start of every request's context that all requests read from the same
    blocks: whole blocks, leaving each request at least one key past them (its own suffix)."""
    if block_table.shape[0] == 0:
        return 0
    limit = min((int(seq_lens.min()) - 1) // block_size, block_table.shape[1])
    if limit <= 0:
        return 0
    head = block_table[:, :limit]
    same = (head == head[0]).all(axis=0)
    return (limit if same.all() else int(np.argmin(same))) * block_size


def cascade_prefix_len(block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, block_size: int) -> int:
    """The ``common_prefix_len`` a decode-only step uses for cascade attention; 0 where it would not pay."""
    if block_table.shape[0] < CASCADE_MIN_REQS or int(query_lens.max()) != 1:
        return 0
    n = common_prefix_len(block_table, seq_lens, block_size)
    return n if n >= CASCADE_MIN_PREFIX_TOKENS else 0
