"""ForwardBatch: the tensors of one forward pass, built from exactly what the scheduler charged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from tallyserve.attention.metadata import AttentionMetadata, cascade_prefix_len
from tallyserve.core.sched_output import SchedulerOutput


def upload_arrays(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Tensors of ``arrays`` (cast to ``dtype``) on ``device``. On CUDA they are packed into one
    pinned host buffer and moved by ONE non-blocking copy (views of it come back); the caching host
    allocator keeps the buffer alive until the copy has run. On the CPU: zero-copy ``from_numpy``."""
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np_dtype)).to(device) for a in arrays]
    # Every piece starts 16-byte aligned, like a fresh allocation: Triton specialises kernels on
    # pointer alignment, so unaligned views would compile new variants as batch sizes change.
    align = max(1, 16 // np_dtype.itemsize)
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.size // align) * align
    host = torch.empty(max(total, 1), dtype=dtype, pin_memory=True)
    flat = host.numpy()
    for a, off in zip(arrays, offsets):
        flat[off:off + a.size] = a.reshape(-1)
    dev = host.to(device, non_blocking=True)
    return [dev[off:off + a.size].view(a.shape) for a, off in zip(arrays, offsets)]


def block_table(reqs) -> np.ndarray:
    """(requests, widest block table) int64: each scheduled request's block ids, padded with 0."""
    table = np.zeros((len(reqs), max(max((len(r.block_ids) for r in reqs), default=1), 1)), dtype=np.int64)
    for i, r in enumerate(reqs):
        table[i, : len(r.block_ids)] = r.block_ids
    return table


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows whose logits are sampled (1 + drafts per sampling request)
    sample_request_ids: tuple[str, ...]  # requests that sample, in order
    sample_row_counts: tuple[int, ...]  # logits rows of each of them
    num_tokens: int
    # Async scheduling: input_ids[fill_rows] are placeholders; the runner copies them on the device
    # from the previous step's sampled tokens, fill_src indexing that step's token tensor.
    fill_rows: Optional[torch.Tensor] = None
    fill_src: Optional[torch.Tensor] = None
    # logits_indices is every row in order (a decode-only step): the logits need no gather
    logits_all_rows: bool = False

    @classmethod
    def build(cls, output: SchedulerOutput, block_size: int, device: torch.device,
              placeholder_src: Optional[Mapping[str, int]] = None, cascade: bool = False) -> "ForwardBatch":
        """``placeholder_src``: request id -> row of the in-flight step's sampled-token tensor,
        needed when an async-scheduled step feeds on tokens that step has not returned yet.
        ``cascade``: the attention backend can attend a prefix shared by every request once per
        step (decode-only steps of enough requests then carry ``common_prefix_len``)."""
        reqs = output.requests
        num_reqs = len(reqs)
        query_lens = np.fromiter((r.num_tokens for r in reqs), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((r.start_position for r in reqs), dtype=np.int64, count=num_reqs)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        # Position of each row: its request's start plus its offset inside the request's rows.
        req_of_row = np.repeat(np.arange(num_reqs), query_lens)
        positions = starts[req_of_row] + (np.arange(num_tokens) - cu[:-1][req_of_row])
        table = block_table(reqs)
        block_of_row = table[req_of_row, positions // block_size]
        slot_mapping = block_of_row * block_size + positions % block_size
        seq_lens = starts + query_lens
        sample_rows = [
            row for i, r in enumerate(reqs) if r.sample for row in range(int(cu[i + 1]) - r.num_sample_rows, int(cu[i + 1]))
        ]
        fill_rows = np.flatnonzero(input_ids < 0)
        fill_src = np.zeros(0, dtype=np.int64)
        if fill_rows.size:
            if placeholder_src is None:
                raise ValueError("the batch holds placeholder tokens but no in-flight step supplies them")
            fill_src = np.fromiter((placeholder_src[reqs[i].request_id] for i in req_of_row[fill_rows]),
                                   dtype=np.int64, count=fill_rows.size)
        # one pinned host->device copy per dtype on CUDA (see upload_arrays)
        ids_t, positions_t, slots_t, sample_t, fill_rows_t, fill_src_t = upload_arrays(
            [input_ids, positions, slot_mapping, np.asarray(sample_rows, dtype=np.int64), fill_rows, fill_src],
            torch.int64, device)
        prefix_len = cascade_prefix_len(table, seq_lens, query_lens, block_size) if cascade and num_reqs else 0
        int32 = [cu, seq_lens, table] + ([np.array([prefix_len])] if prefix_len else [])
        cu_t, seq_lens_t, table_t, *prefix_t = upload_arrays(int32, torch.int32, device)
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            query_start_loc=cu_t,
            seq_lens=seq_lens_t,
            block_tables=table_t,
            query_start_loc_cpu=tuple(int(x) for x in cu),
            seq_lens_cpu=tuple(int(x) for x in seq_lens),
            block_size=block_size,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            common_prefix_len=prefix_len,
            prefix_kv_lens=prefix_t[0] if prefix_t else None,
        )
        return cls(
            input_ids=ids_t,
            positions=positions_t,
            attn_meta=meta,
            logits_indices=sample_t,
            sample_request_ids=tuple(r.request_id for r in reqs if r.sample),
            sample_row_counts=tuple(r.num_sample_rows for r in reqs if r.sample),
            num_tokens=num_tokens,
            fill_rows=fill_rows_t if fill_rows.size else None,
            fill_src=fill_src_t if fill_rows.size else None,
            logits_all_rows=len(sample_rows) == num_tokens > 0,
        )
