"""ForwardBatch: the tensors of one forward pass, built from exactly what the scheduler charged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from tallyserve.attention.metadata import AttentionMetadata, OutputRows, cascade_prefix_len, output_rows_metadata
from tallyserve.core.sched_output import SchedulerOutput
from tallyserve.runner.host_tensors import upload, upload_packed


def graph_input_arrays(bucket: int, width: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                       seq_lens: np.ndarray, table: np.ndarray) -> list[tuple[np.ndarray, torch.dtype]]:
    """A decode step's inputs as a CUDA graph of ``bucket`` requests reads them, in one packed layout
    (``pack``) that depends only on (bucket, width): ids, positions, slots (int64), sequence lengths and
    a (bucket, width) block table (int32), rows past the step's requests set to padding (slot -1,
    length 0: they write and read nothing). The graph runner keeps a device copy of this layout per
    small bucket, so the step's inputs reach it in one device copy."""
    n = len(input_ids)

    def padded(a, fill, dtype):
        out = np.full(bucket, fill, dtype=dtype)
        out[:n] = a
        return out
    wide = np.zeros((bucket, width), dtype=np.int32)
    wide[:n, :table.shape[1]] = table
    return [(padded(input_ids, 0, np.int64), torch.int64), (padded(positions, 0, np.int64), torch.int64),
            (padded(slot_mapping, -1, np.int64), torch.int64), (padded(seq_lens, 0, np.int32), torch.int32),
            (wide, torch.int32)]


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
    # a decode step packed for a CUDA graph's bucket (``graph_input_arrays``): the layout's device bytes,
    # which input_ids / positions / the metadata's tensors are views of (fills included)
    graph_inputs: Optional[torch.Tensor] = None
    # the sampled rows, for a model that leaves the other rows out of its last layer (``build(output_rows=True)``
    # on a step whose other rows nothing reads: some rows sampled, not all, no prompt logprobs); the model then
    # returns the hidden states of exactly logits_indices' rows, in their order
    output_rows: Optional[OutputRows] = None

    @classmethod
    def build(cls, output: SchedulerOutput, block_size: int, device: torch.device,
              placeholder_src: Optional[Mapping[str, int]] = None, cascade: bool = False,
              graph_layout: Optional[Callable[[int, int], Optional[tuple[int, int]]]] = None,
              output_rows: bool = False) -> "ForwardBatch":
        """``placeholder_src``: request id -> row of the in-flight step's sampled-token tensor,
        needed when an async-scheduled step feeds on tokens that step has not returned yet.
        ``cascade``: the attention backend can attend a prefix shared by every request once per
        step (decode-only steps of enough requests then carry ``common_prefix_len``).
        ``graph_layout(num_reqs, table_width)``: (bucket, width) when a CUDA graph would replay this
        decode step from packed inputs (``graph_input_arrays``), else None.
        ``output_rows``: the model can leave the rows nobody samples out of its last layer (see the field)."""
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
        # one pinned host->device copy on CUDA (see upload)
        prefix_len = cascade_prefix_len(table, seq_lens, query_lens, block_size) if cascade and num_reqs else 0
        rest = ([(a, torch.int64) for a in (np.asarray(sample_rows, dtype=np.int64), fill_rows, fill_src)]
                + [(a, torch.int32) for a in [cu] + ([np.array([prefix_len])] if prefix_len else [])])
        layout = None
        if graph_layout is not None and num_tokens == num_reqs > 0:
            layout = graph_layout(num_reqs, table.shape[1])
        graph_inputs = None
        if layout is not None:  # the graph's layout first; the step's tensors are views of it
            packed = graph_input_arrays(*layout, input_ids, positions, slot_mapping, seq_lens, table)
            tensors, dev, offsets = upload_packed(packed + rest, device)
            ids_t, positions_t, slots_t, seq_lens_t, table_t = (t[:num_reqs] for t in tensors[:5])
            sample_t, fill_rows_t, fill_src_t, cu_t, *prefix_t = tensors[5:]
            graph_inputs = dev[:offsets[5]]
        else:
            (ids_t, positions_t, slots_t, seq_lens_t, table_t, sample_t, fill_rows_t, fill_src_t, cu_t,
             *prefix_t) = upload([(input_ids, torch.int64), (positions, torch.int64), (slot_mapping, torch.int64),
                                  (seq_lens, torch.int32), (table, torch.int32)] + rest, device)
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
        out = None
        if output_rows and 0 < len(sample_rows) < num_tokens and not any(r.prompt_logprob_targets for r in reqs):
            out = output_rows_metadata(meta, [r.num_sample_rows if r.sample else 0 for r in reqs])
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
            graph_inputs=graph_inputs,
            output_rows=out,
        )
