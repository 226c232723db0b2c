"""The rows a step's last layer computes when only some rows are sampled (``ForwardBatch.output_rows``,
``attention/metadata.output_rows_metadata``): which rows, the metadata they attend with, and the steps that
keep every row (nothing to leave out, or prompt logprobs read every row)."""

from __future__ import annotations

import pytest
import torch

from tallyserve.attention.metadata import output_rows_metadata
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8)


def _step(*reqs: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(step_id=1, requests=tuple(reqs), total_tokens=sum(r.num_tokens for r in reqs))


def _req(rid, n, start, blocks, sample, drafts=0, targets=()):
    return ScheduledRequest(rid, tuple(range(10, 10 + n)), start, blocks, sample, PARAMS, 0, num_draft_tokens=drafts,
                            prompt_logprob_targets=targets)


MIXED = _step(
    _req("chunk", 5, 0, (7, 8), False),  # a prompt chunk that does not reach the end: nothing sampled
    _req("last", 7, 4, (3, 9, 11), True),  # a prompt's last chunk: its last row
    _req("drafts", 3, 20, (1, 2, 4, 5, 6, 12), True, drafts=2),  # a decode row and two drafts: three rows
    _req("decode", 1, 6, (13, 14), True),
)


def test_the_sampled_rows_and_their_metadata():
    batch = ForwardBatch.build(MIXED, 4, torch.device("cpu"), output_rows=True)
    out = batch.output_rows
    assert out.rows.tolist() == batch.logits_indices.tolist() == [11, 12, 13, 14, 15]
    m, full = out.meta, batch.attn_meta
    assert m.query_start_loc_cpu == (0, 1, 4, 5) and m.query_start_loc.tolist() == [0, 1, 4, 5]
    assert m.seq_lens_cpu == (11, 23, 7) and m.seq_lens.tolist() == [11, 23, 7]
    assert torch.equal(m.block_tables, full.block_tables[1:])
    assert torch.equal(m.slot_mapping, full.slot_mapping[[11, 12, 13, 14, 15]])
    assert (m.max_query_len, m.max_seq_len, m.num_tokens, m.num_reqs) == (3, 23, 5, 3)
    assert m.common_prefix_len == 0


def test_steps_that_keep_every_row():
    assert ForwardBatch.build(MIXED, 4, torch.device("cpu")).output_rows is None, "not asked"
    decode = _step(_req("a", 1, 6, (13, 14), True), _req("b", 1, 3, (2,), True))
    assert ForwardBatch.build(decode, 4, torch.device("cpu"), output_rows=True).output_rows is None, "every row sampled"
    chunk = _step(_req("chunk", 5, 0, (7, 8), False))
    assert ForwardBatch.build(chunk, 4, torch.device("cpu"), output_rows=True).output_rows is None, "no row sampled"
    logprobs = _step(_req("lp", 5, 0, (7, 8), True, targets=(11, 12, 13, 14)), _req("decode", 1, 6, (13, 14), True))
    assert ForwardBatch.build(logprobs, 4, torch.device("cpu"), output_rows=True).output_rows is None, \
        "prompt logprobs read every prompt row"


def test_bad_counts_are_refused():
    meta = ForwardBatch.build(MIXED, 4, torch.device("cpu")).attn_meta
    with pytest.raises(ValueError, match="one count per request"):
        output_rows_metadata(meta, [1, 1])
    with pytest.raises(ValueError, match="request 3 keeps 2 of its 1 query rows"):
        output_rows_metadata(meta, [0, 1, 3, 2])
    with pytest.raises(ValueError, match="request 0 keeps -1"):
        output_rows_metadata(meta, [-1, 1, 3, 1])
