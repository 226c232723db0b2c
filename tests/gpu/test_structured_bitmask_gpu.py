"""Grammar bitmasks on the GPU (tallyserve/runner/grammar_mask.py): the device path masks
exactly the tokens the CPU path masks, only on the grammar rows, and queues without waiting for
the device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.core.sched_output import GrammarBitmask
from tallyserve.runner.grammar_mask import allowed_from_bitmask, apply_grammar_bitmask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _so(bitmask: torch.Tensor) -> SchedulerOutput:
    p = SamplingParams()
    entries = (
        ScheduledRequest("plain", (5,), 3, (0,), True, p, 1),
        ScheduledRequest("g", (7, 8, 9), 4, (1,), True, p, 1, num_draft_tokens=2),  # 3 rows
        ScheduledRequest("prefill", (1, 2), 0, (2,), False, p, 0),  # no rows
        ScheduledRequest("g2", (4,), 9, (3,), True, p, 2),
    )
    return SchedulerOutput(1, entries, 7, grammar_bitmask=GrammarBitmask(frozenset({"g", "g2"}), bitmask))


def test_device_masking_matches_the_host_bitmask():
    vocab = 128256  # Llama-3's vocabulary: not a multiple of 32 in the last word's use
    gen = torch.Generator().manual_seed(0)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen).cuda()
    raw = logits
    out = apply_grammar_bitmask(_so(bitmask), logits, raw)
    assert out is not raw and torch.equal(raw, logits)  # the reported logprobs keep the model's logits
    allowed = allowed_from_bitmask(bitmask, vocab).cuda()
    rows = [1, 2, 3, 4]  # "g" (3 rows) then "g2"; row 0 ("plain") untouched
    assert torch.equal(out[0], raw[0])
    for i, r in enumerate(rows):
        assert torch.equal(torch.isfinite(out[r]), allowed[i])
        assert torch.equal(out[r][allowed[i]], raw[r][allowed[i]])


def test_device_masking_does_not_wait_for_the_device():
    vocab, words = 4096, 128
    bitmask = torch.zeros((4, words), dtype=torch.int32)
    bitmask[:, 0] = 1  # only token 0
    logits = torch.randn(5, vocab, device="cuda")
    apply_grammar_bitmask(_so(bitmask), logits.clone(), None)  # compiles the masking kernel once, before timing
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the stream busy: a host sync would wait for this
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    import time

    t0 = time.perf_counter()
    out = apply_grammar_bitmask(_so(bitmask), logits, None)
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert queued < 0.05, f"masking waited {queued:.3f}s for the device"
    assert torch.equal(out[1:].argmax(dim=-1).cpu(), torch.zeros(4, dtype=torch.long))
