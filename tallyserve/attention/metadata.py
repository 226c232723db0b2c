"""AttentionMetadata: what every attention backend reads for one forward pass.

Built by runner/forward_batch.py from a SchedulerOutput. Token rows are laid out request by
request: request i owns query rows [query_start_loc[i], query_start_loc[i+1]), which are its
token positions [seq_lens[i] - query_len_i, seq_lens[i]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1] if self.query_start_loc_cpu else 0
