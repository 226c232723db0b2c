"""ForwardBatch: the tensors of one forward pass, built from exactly what the scheduler charged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tallyserve.attention.metadata import AttentionMetadata
from tallyserve.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) rows whose logits are sampled
    sample_request_ids: tuple[str, ...]  # request of each sampled row, in order
    num_tokens: int

    @classmethod
    def build(cls, output: SchedulerOutput, block_size: int, device: torch.device) -> "ForwardBatch":
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
        max_blocks = max((len(r.block_ids) for r in reqs), default=1)
        table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
        for i, r in enumerate(reqs):
            table[i, : len(r.block_ids)] = r.block_ids
        block_of_row = table[req_of_row, positions // block_size]
        slot_mapping = block_of_row * block_size + positions % block_size
        seq_lens = starts + query_lens
        sample_rows = [int(cu[i + 1]) - 1 for i, r in enumerate(reqs) if r.sample]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device, non_blocking=True),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
            block_tables=torch.from_numpy(table.astype(np.int32)).to(device, non_blocking=True),
            query_start_loc_cpu=tuple(int(x) for x in cu),
            seq_lens_cpu=tuple(int(x) for x in seq_lens),
            block_size=block_size,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        )
        return cls(
            input_ids=torch.from_numpy(input_ids).to(device, non_blocking=True),
            positions=torch.from_numpy(positions).to(device, non_blocking=True),
            attn_meta=meta,
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            sample_request_ids=tuple(r.request_id for r in reqs if r.sample),
            num_tokens=num_tokens,
        )
