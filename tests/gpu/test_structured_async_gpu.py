"""Structured outputs under async scheduling on a GPU: the bitmask rows live in two reused pinned
host buffers, each refilled only after the device has read it, and an engine run with grammar
and plain rows overlapping answers exactly as synchronous scheduling. Skipped without CUDA."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tallyserve import LLM
from tallyserve.structured_output.bitmask import HostBitmaskBuffers
from tests.model.test_structured_async import PERSON, StepTrace, _check_ledger, _mixed_batch, _tokens
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_pinned_buffer_is_refilled_only_after_the_device_read_it():
    bufs = HostBitmaskBuffers(1024, pin_memory=True)
    first = bufs.take(8)
    assert first.is_pinned() and first.shape == (8, 1024)
    first.fill_(1)
    torch.cuda._sleep(200_000_000)  # the stream is busy: the upload below runs late
    on_device = first.to("cuda", non_blocking=True)
    bufs.uploaded()
    second = bufs.take(8)  # the other buffer: free at once
    assert second.data_ptr() != first.data_ptr()
    second.fill_(2)
    bufs.uploaded()
    third = bufs.take(8)  # the first buffer again: waits until the device copied it
    assert third.data_ptr() == first.data_ptr()
    third.fill_(3)
    assert torch.equal(on_device.cpu(), torch.ones((8, 1024), dtype=torch.int32))
    assert bufs.take(300).shape == (300, 1024)  # grows when a step has more rows


def test_engine_on_cuda_overlaps_grammar_rows_and_matches_sync(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama")
    make_tiny_tokenizer(model_dir)
    prompts, params = _mixed_batch()
    kw = dict(model=model_dir, block_size=16, dtype="float32", device="cuda")
    want = LLM(async_scheduling=False, **kw).generate(prompts, params)
    llm = LLM(async_scheduling=True, **kw)
    assert llm.engine.structured._buffers.pin_memory
    trace = StepTrace(llm)
    outs = llm.generate(prompts, params)
    assert _tokens(outs) == _tokens(want)
    for o, p in zip(outs, params):
        if p.structured_outputs is not None:
            jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    for rid in trace.grammar_ids:
        assert trace.overlapped(rid) == len(trace.steps_sampling(rid)) - 1
    _check_ledger(llm)
