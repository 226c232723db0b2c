"""Cascade attention's host side: which decode steps name a shared prefix, and how long it is
(``attention/metadata.py``), the batch that carries it (``ForwardBatch.build``), the CUDA-graph runner
that replays the cascade variant, and the engine argument. The kernels themselves are checked under
Triton's interpreter (tests/unit/test_triton_interpret.py, ``cascade_*`` cases) and on the GPU."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tallyserve.attention.metadata import (
    CASCADE_MIN_PREFIX_TOKENS, CASCADE_MIN_REQS, cascade_prefix_len, common_prefix_len,
)
from tallyserve.config import EngineArgs
from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
from tallyserve.runner.forward_batch import ForwardBatch
from tallyserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_common_prefix_len_exact():
    bs = 4
    table = np.array([[7, 3, 9, 5, 0], [7, 3, 9, 6, 2], [7, 3, 8, 1, 0]])
    assert common_prefix_len(table, np.array([20, 20, 20]), bs) == 2 * bs  # block 2 differs in row 2
    assert common_prefix_len(table[:2], np.array([20, 20]), bs) == 3 * bs
    # every request keeps at least one key of its own: seq_len 12 allows 2 whole shared blocks
    assert common_prefix_len(table[:2], np.array([12, 20]), bs) == 2 * bs
    assert common_prefix_len(table[:2], np.array([13, 20]), bs) == 3 * bs
    assert common_prefix_len(table[:1], np.array([17]), bs) == 4 * bs  # one request: its own blocks
    assert common_prefix_len(np.array([[1, 2], [3, 2]]), np.array([8, 8]), bs) == 0  # first block differs
    assert common_prefix_len(np.zeros((0, 3), dtype=np.int64), np.zeros(0), bs) == 0
    assert common_prefix_len(table, np.array([1, 20, 20]), bs) == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_common_prefix_len_matches_a_slot_by_slot_scan(data):
    """Random tables with a planted common start: the result is the longest run of whole blocks at
    the start that every row shares, capped so each row has a key past it."""
    bs = data.draw(st.integers(1, 8))
    rows = data.draw(st.integers(1, 6))
    width = data.draw(st.integers(1, 8))
    planted = data.draw(st.integers(0, width))
    base = data.draw(st.lists(st.integers(0, 5), min_size=width, max_size=width))
    table = np.array([base[:planted] + data.draw(st.lists(st.integers(0, 5), min_size=width - planted,
                                                          max_size=width - planted)) for _ in range(rows)])
    seq_lens = np.array(data.draw(st.lists(st.integers(1, width * bs), min_size=rows, max_size=rows)))
    got = common_prefix_len(table, seq_lens, bs)
    n = 0
    while n < width and all(table[r, n] == table[0, n] for r in range(rows)) and all(
            (n + 1) * bs < s for s in seq_lens):
        n += 1
    assert got == n * bs


def _table_with_prefix(num_reqs, shared, own, seed=0):
    rng = random.Random(seed)
    prefix = list(range(100, 100 + shared))
    return np.array([prefix + [rng.randrange(1000, 2000) for _ in range(own)] for _ in range(num_reqs)])


def test_cascade_prefix_len_thresholds():
    bs = 16
    blocks = CASCADE_MIN_PREFIX_TOKENS // bs
    table = _table_with_prefix(CASCADE_MIN_REQS, blocks, 2)
    lens = np.full(CASCADE_MIN_REQS, (blocks + 2) * bs)
    ones = np.ones(CASCADE_MIN_REQS, dtype=np.int64)
    assert cascade_prefix_len(table, lens, ones, bs) == CASCADE_MIN_PREFIX_TOKENS
    assert cascade_prefix_len(table[:-1], lens[:-1], ones[:-1], bs) == 0, "too few requests"
    twos = ones.copy()
    twos[3] = 2
    assert cascade_prefix_len(table, lens, twos, bs) == 0, "a row with two query tokens (prefill or drafts)"
    short = _table_with_prefix(CASCADE_MIN_REQS, blocks - 1, 3)
    assert cascade_prefix_len(short, lens, ones, bs) == 0, "prefix below the minimum"


def _decode_step(num_reqs, shared, own, bs, query_len=1):
    table = _table_with_prefix(num_reqs, shared, own, seed=1)
    params = SamplingParams(max_tokens=4)
    reqs = tuple(
        ScheduledRequest(f"r{i}", tuple(range(5, 5 + query_len)), (shared + own) * bs - query_len - i % 3,
                         tuple(int(b) for b in table[i]), True, params, 1)
        for i in range(num_reqs))
    return SchedulerOutput(step_id=1, requests=reqs, total_tokens=num_reqs * query_len)


def test_forward_batch_names_the_shared_prefix_only_when_asked():
    so = _decode_step(CASCADE_MIN_REQS + 2, shared=20, own=3, bs=16)
    plain = ForwardBatch.build(so, 16, torch.device("cpu"))
    assert plain.attn_meta.common_prefix_len == 0 and plain.attn_meta.prefix_kv_lens is None
    batch = ForwardBatch.build(so, 16, torch.device("cpu"), cascade=True)
    assert batch.attn_meta.common_prefix_len == 20 * 16
    assert batch.attn_meta.prefix_kv_lens.tolist() == [20 * 16]
    assert batch.attn_meta.prefix_kv_lens.dtype == torch.int32
    # the rest of the batch is the same either way
    assert torch.equal(plain.attn_meta.block_tables, batch.attn_meta.block_tables)
    assert torch.equal(plain.attn_meta.seq_lens, batch.attn_meta.seq_lens)
    prefill = _decode_step(CASCADE_MIN_REQS + 2, shared=20, own=3, bs=16, query_len=3)
    assert ForwardBatch.build(prefill, 16, torch.device("cpu"), cascade=True).attn_meta.common_prefix_len == 0


def test_disable_cascade_attn_argument():
    assert EngineArgs().disable_cascade_attn is False
    EngineArgs(disable_cascade_attn=True).validate()
    with pytest.raises(ValueError, match="disable_cascade_attn"):
        EngineArgs(disable_cascade_attn="yes").validate()


def test_cli_has_disable_cascade_attn():
    import argparse

    from tallyserve.config.args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--disable-cascade-attn"]).disable_cascade_attn is True
    assert not parser.parse_args([]).disable_cascade_attn


def test_runner_builds_cascade_batches_only_with_a_capable_backend_and_the_switch_on(tmp_path):
    from tallyserve.attention.torch_ref import TorchRefBackend
    from tallyserve.models.loader import load_model, resolve_model
    from tallyserve.runner.model_runner import ModelRunner
    from tiny_models import make_tiny_model

    class CascadeCapable(TorchRefBackend):
        supports_cascade = True

    path = make_tiny_model(tmp_path, "llama")
    resolved = resolve_model(path, "auto")
    so = _decode_step(CASCADE_MIN_REQS + 2, shared=20, own=3, bs=16)
    got = {}
    for backend in (TorchRefBackend(), CascadeCapable()):
        model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, backend)
        for switch in (True, False):
            runner = ModelRunner(model, resolved.model_config, 16, 16, torch.device("cpu"), torch.float32,
                                 use_cascade_attn=switch)
            got[type(backend).__name__, switch] = runner.prepare(so).attn_meta.common_prefix_len
    assert got == {("TorchRefBackend", True): 0, ("TorchRefBackend", False): 0,
                   ("CascadeCapable", True): 320, ("CascadeCapable", False): 0}


def test_engine_argument_reaches_the_runner(tmp_path, monkeypatch):
    from tallyserve import LLM
    from tallyserve.executor import uniproc
    from tiny_models import make_tiny_model

    seen = []
    real = uniproc.ModelRunner

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_cascade_attn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(uniproc, "ModelRunner", spy)
    path = make_tiny_model(tmp_path, "llama")
    for disable in (False, True):
        LLM(model=path, device="cpu", dtype="float32", disable_cascade_attn=disable)
    assert seen == [True, False]


def test_forward_batch_marks_steps_whose_logits_are_every_row():
    """A step sampling every row in order (decode-only) needs no logits gather; a prefill chunk
    that does not sample, or a step with query rows that are not sampled, does."""
    decode = ForwardBatch.build(_decode_step(3, shared=1, own=2, bs=16), 16, torch.device("cpu"))
    assert decode.logits_all_rows and decode.logits_indices.tolist() == [0, 1, 2]
    prefill = ForwardBatch.build(_decode_step(3, shared=1, own=2, bs=16, query_len=4), 16, torch.device("cpu"))
    assert not prefill.logits_all_rows and prefill.logits_indices.tolist() == [3, 7, 11]
    so = _decode_step(3, shared=1, own=2, bs=16)
    chunk = so.requests[1]._replace(sample=False)  # a prefill chunk that ends before its prompt does
    mixed = ForwardBatch.build(dataclasses.replace(so, requests=(so.requests[0], chunk, so.requests[2])),
                               16, torch.device("cpu"))
    assert not mixed.logits_all_rows and mixed.logits_indices.tolist() == [0, 2]


def test_pack_puts_every_dtype_in_one_aligned_buffer():
    """The batch's int64 and int32 arrays travel in one host buffer (one copy to the device); each
    piece starts 16-byte aligned and comes back with its dtype, shape and values."""
    from tallyserve.runner.host_tensors import pack

    arrays = [(np.array([3, -1, 7]), torch.int64), (np.zeros(0, dtype=np.int64), torch.int64),
              (np.array([[1, 2], [3, 4], [5, 6]]), torch.int32), (np.array([2**31 - 1]), torch.int32),
              (np.arange(5), torch.int64)]
    host, views = pack(arrays)
    assert host.dtype == torch.uint8 and host.numel() == 32 + 0 + 32 + 16 + 48
    out = views(host.clone())
    for (a, dtype), t in zip(arrays, out):
        assert t.dtype == dtype and tuple(t.shape) == a.shape and t.tolist() == a.tolist()
        assert t.data_ptr() % 16 == 0 or t.numel() == 0
