"""The full-budget forward the runner uses to profile activation memory and, on CUDA, to warm up once the KV
pool exists (model_runner._full_budget_forward / warm_up_full_budget): it computes a whole token budget without
writing any KV cache, and the warm-up never stops an engine from starting."""

from __future__ import annotations

import logging

import pytest
import torch

from tallyserve.config import EngineArgs
from tallyserve.models.loader import load_model, resolve_model
from tallyserve.runner import model_runner
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    resolved = resolve_model(make_tiny_model(tmp_path_factory.mktemp("warm"), "llama"), "auto")
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, None)
    return model, resolved.model_config


def test_full_budget_forward_runs_the_whole_budget_and_writes_no_cache(tiny, monkeypatch):
    model, mc = tiny
    args = EngineArgs(model="x", max_num_batched_tokens=96, max_model_len=40, block_size=4, max_num_seqs=5)
    seen = {}
    real_forward = model.forward

    def spy(input_ids, positions, kv_caches, meta):
        seen.update(tokens=input_ids.shape[0], caches={c.data_ptr() for c in kv_caches}, meta=meta)
        out = real_forward(input_ids, positions, kv_caches, meta)
        seen["cache_after"] = kv_caches[0].clone()
        return out

    monkeypatch.setattr(model, "forward", spy)
    assert model_runner._full_budget_forward(model, args, mc, torch.device("cpu")) == 96
    assert seen["tokens"] == 96
    assert len(seen["caches"]) == 1  # one scratch block shared by every layer, not a KV pool
    # requests of at most max_model_len tokens cover the budget; no slot is written
    assert seen["meta"].seq_lens_cpu == (40, 40, 16)
    assert bool((seen["meta"].slot_mapping == -1).all())
    assert bool((seen["cache_after"] == 0).all())


def test_warm_up_only_on_cuda(tiny, monkeypatch):
    model, mc = tiny
    args = EngineArgs(model="x", max_num_batched_tokens=32, max_model_len=32, block_size=4, max_num_seqs=4)
    calls = []
    monkeypatch.setattr(model_runner, "_full_budget_forward", lambda *a: calls.append(a[-1]) or 32)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    assert not model_runner.warm_up_full_budget(model, args, mc, torch.device("cpu"))
    assert calls == []
    assert model_runner.warm_up_full_budget(model, args, mc, torch.device("cuda"))
    assert calls == [torch.device("cuda")]


def test_warm_up_out_of_memory_is_logged_not_raised(tiny, monkeypatch, caplog):
    model, mc = tiny
    args = EngineArgs(model="x", max_num_batched_tokens=32, max_model_len=32, block_size=4, max_num_seqs=4)

    def oom(*a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(model_runner, "_full_budget_forward", oom)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert not model_runner.warm_up_full_budget(model, args, mc, torch.device("cuda"))
    assert "warm-up" in caplog.text

    def workspace(*a):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(model_runner, "_full_budget_forward", workspace)
    assert not model_runner.warm_up_full_budget(model, args, mc, torch.device("cuda"))

    def broken(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(model_runner, "_full_budget_forward", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):  # not a memory shortage: the engine must not start
        model_runner.warm_up_full_budget(model, args, mc, torch.device("cuda"))
