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


@dataclass(frozen=True)
class OutputRows:
    """The rows of a step whose final hidden states anything reads (the sampled rows), for a model that can leave
    the others out of its last layer: their K/V still go into the cache there, but they skip its attention, output
    projection and MLP. ``rows``: (S,) int64 indices of the rows among the step's, request by request;
    ``meta``: the metadata of attending exactly those rows over the same keys (``output_rows_metadata``)."""

    rows: torch.Tensor
    meta: AttentionMetadata


def output_rows_metadata(meta: AttentionMetadata, keep: list[int]) -> OutputRows:
    """Of each request i, its last ``keep[i]`` query rows (none where 0): their indices among the step's rows and
    the metadata of attending them alone over the same keys, K/V rows already in the cache (requests that keep no
    row are left out)."""
    qsl = meta.query_start_loc_cpu
    if len(keep) != meta.num_reqs:
        raise ValueError(f"one count per request: {len(keep)} for {meta.num_reqs} requests")
    for i, k in enumerate(keep):
        if not 0 <= k <= qsl[i + 1] - qsl[i]:
            raise ValueError(f"request {i} keeps {k} of its {qsl[i + 1] - qsl[i]} query rows")
    reqs = [i for i, k in enumerate(keep) if k]
    rows = [row for i in reqs for row in range(qsl[i + 1] - keep[i], qsl[i + 1])]
    cu = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum([keep[i] for i in reqs], out=cu[1:])
    device = meta.seq_lens.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    reqs_t = torch.tensor(reqs, dtype=torch.int64, device=device)
    seq_lens = tuple(meta.seq_lens_cpu[i] for i in reqs)
    return OutputRows(rows_t, AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows_t],
        query_start_loc=torch.tensor(cu, dtype=meta.query_start_loc.dtype, device=device),
        seq_lens=meta.seq_lens[reqs_t],
        block_tables=meta.block_tables[reqs_t],
        query_start_loc_cpu=tuple(int(x) for x in cu),
        seq_lens_cpu=seq_lens,
        block_size=meta.block_size,
        max_query_len=max((keep[i] for i in reqs), default=0),
        max_seq_len=max(seq_lens, default=0),
    ))


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
