"""CUDA-graph decode replay (tallyserve/runner/cuda_graph.py).

CPU part (always runs): the runner's buckets, static buffers, copy-in and padding logic, with a
fake graph factory whose "replay" re-runs the captured function on the same static buffers, and a
test-only graph-safe torch attention backend (reads lengths only from device tensors). Padding
requests must never write a cache slot and real rows must equal an eager reference.

The GPU part is test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu, for graph_helpers
from graph_helpers import load_tiny, make_batch  # noqa: E402
from tiny_models import PagedKV  # noqa: E402

from tallyserve.attention import torch_ref  # noqa: E402
from tallyserve.attention.backend import AttentionBackend, get_attn_backend  # noqa: E402
from tallyserve.runner.cuda_graph import CudaGraphRunner, batch_buckets  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --------------------------------------------------------------------------- test doubles (CPU)
class StaticDecodeBackend(AttentionBackend):
    """Graph-safe torch attention for decode-only steps: fixed shapes, lengths from device tensors
    only (so a captured call replays correctly with other lengths); prefill goes to the reference."""

    name = "static_torch"
    supports_cuda_graph = True

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=(1.0, 1.0)):
        if meta.max_query_len > 1:
            return torch_ref.TorchRefBackend().forward(q, k, v, kv_cache, meta, scale, kv_scale)
        nb, bs, hkv, dim = kv_cache.shape[1:]
        flat = kv_cache.view(2, nb * bs, hkv, dim)
        slots = meta.slot_mapping
        keep = slots >= 0
        flat[0, slots[keep]] = k[keep].to(kv_cache.dtype)
        flat[1, slots[keep]] = v[keep].to(kv_cache.dtype)
        width = meta.block_tables.shape[1] * bs
        pos = torch.arange(width)
        lens = meta.seq_lens.long()
        slot_of = meta.block_tables.long()[:, pos // bs] * bs + pos % bs  # (B, width)
        keys, values = flat[0][slot_of].float(), flat[1][slot_of].float()  # (B, width, Hkv, D)
        valid = pos[None, :] < lens[:, None]
        keys = torch.where(valid[:, :, None, None], keys, 0.0)  # unwritten slots may hold NaN
        values = torch.where(valid[:, :, None, None], values, 0.0)
        group = q.shape[1] // hkv
        qs = q.float().view(q.shape[0], hkv, group, dim)
        scores = torch.einsum("bhgd,bkhd->bhgk", qs, keys) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # seq_len 0 (padding): all -inf -> zeros
        return torch.einsum("bhgk,bkhd->bhgd", probs, values).reshape(q.shape).to(q.dtype)


class ReplayByRerun:
    """Fake graph factory: replay re-runs the captured function and refreshes the static output."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn):
        self.captured += 1
        out = fn()

        def replay():
            new = fn()
            for static, fresh in zip(out, new) if isinstance(out, tuple) else ((out, new),):
                static.copy_(fresh)
        return SimpleNamespace(replay=replay), out



# --------------------------------------------------------------------------- CPU tests
def test_buckets():
    assert batch_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert batch_buckets(1000)[-1] == 256
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_fake_replay_matches_eager_and_padding_writes_nothing(tiny_dir):
    """Decode batches of changing size through the graph runner (with bucket padding) vs the eager
    torch reference; prefill chunks run eagerly in between, as the ModelRunner would."""
    ref_model, graph_model = load_tiny(tiny_dir, None), load_tiny(tiny_dir, StaticDecodeBackend())
    ref_kv = PagedKV(ref_model, num_blocks=64, block_size=4, seed=3)
    graph_kv = PagedKV(graph_model, num_blocks=64, block_size=4, seed=3)  # same block ids handed out
    factory = ReplayByRerun()
    runner = CudaGraphRunner(graph_model, graph_kv.kv_caches, max_num_seqs=8, max_blocks_per_seq=16,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=4, graph_factory=factory)
    runner.capture()
    assert factory.captured == len(runner.buckets) == 4
    assert all(torch.isnan(c).all() for c in graph_kv.kv_caches), "capture must not write the cache"
    rng = random.Random(0)
    prompts = [(f"r{j}", [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]) for j in range(8)]
    for chunk in (prompts[:5], prompts[5:]):  # eager prefills in both
        ref_kv.step(chunk)
        graph_kv.step(chunk)
    # sizes shrink inside buckets, so stale rows of a bigger batch would become live padding rows
    sizes = [8, 5, 3, 4, 1, 2, 7, 6, 5, 2, 3, 8]
    for step, n in enumerate(sizes):
        reqs = rng.sample([rid for rid, _ in prompts], n)
        batch = [(rid, [rng.randrange(3, 250)]) for rid in reqs]
        ref = ref_kv.step(batch)
        ids, positions, meta = graph_kv.build(batch)
        fb = make_batch(ids, positions, meta)
        assert runner.can_run(fb)
        hidden, graph_logits = runner.run(fb)
        assert hidden.shape[0] == len(batch) and graph_logits is None, "no compute_logits given"
        size = runner.bucket_for(n)
        # padding rows of the replayed bucket: no cache write, no key read (stale rows would
        # rewrite slots whose blocks may belong to another request by now)
        _, _, slots, seq_lens, _ = runner.inputs(size)
        assert (slots[n:] == -1).all() and (seq_lens[n:] == 0).all()
        assert torch.equal(slots[:n], meta.slot_mapping)
        logits = graph_model.compute_logits(hidden)
        for row, (rid, _) in enumerate(batch):
            torch.testing.assert_close(logits[row:row + 1], ref[rid], atol=1e-4, rtol=1e-4, msg=f"step {step} {rid}")
    assert runner.num_replays == 12
    # the graph cache equals the reference cache (NaN where never written: padding wrote nothing)
    for a, b in zip(ref_kv.kv_caches, graph_kv.kv_caches):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a.nan_to_num(0.0), b.nan_to_num(0.0), atol=1e-5, rtol=1e-5)


class StaticCascadeBackend(StaticDecodeBackend):
    """The static backend, reading a cascade step's shared prefix from row 0's block table (as the
    Triton kernel does) for the first ``prefix_kv_lens[0]`` keys, so a wrong length would read the
    wrong blocks; counts the steps that came with a prefix."""

    supports_cascade = True

    def __init__(self):
        self.cascade_calls = 0

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=(1.0, 1.0)):
        if meta.prefix_kv_lens is not None and meta.max_query_len == 1:
            # the Triton backend runs the cascade kernels when the host field is set: so must a cascade graph
            assert meta.common_prefix_len > 0, "a prefix tensor without common_prefix_len: plain kernels would run"
            self.cascade_calls += 1
            bs = kv_cache.shape[2]
            cols = torch.arange(meta.block_tables.shape[1]) * bs
            shared = (cols < meta.prefix_kv_lens[0])[None, :]
            meta = dataclasses.replace(meta, block_tables=torch.where(shared, meta.block_tables[:1],
                                                                      meta.block_tables))
        return super().forward(q, k, v, kv_cache, meta, scale, kv_scale)


def test_fake_replay_of_cascade_graphs(tiny_dir):
    """With cascade on, buckets of >= 8 requests get a second graph; a decode step naming a shared
    prefix replays it (the prefix length copied into the static buffer), others the plain graph."""
    backend = StaticCascadeBackend()
    ref_model, graph_model = load_tiny(tiny_dir, None), load_tiny(tiny_dir, backend)
    ref_kv = PagedKV(ref_model, num_blocks=96, block_size=4, seed=3)
    graph_kv = PagedKV(graph_model, num_blocks=96, block_size=4, seed=3)
    factory = ReplayByRerun()
    runner = CudaGraphRunner(graph_model, graph_kv.kv_caches, max_num_seqs=16, max_blocks_per_seq=16,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=4, graph_factory=factory,
                             cascade=True)
    runner.capture()
    assert runner.cascade_sizes == (8, 16) and factory.captured == len(runner.buckets) + 2
    rng = random.Random(2)
    prefix = [rng.randrange(3, 250) for _ in range(12)]  # three whole blocks
    own = {f"r{i}": [rng.randrange(3, 250) for _ in range(1 + i % 3)] for i in range(10)}
    own.update({f"s{i}": [rng.randrange(3, 250) for _ in range(5)] for i in range(10)})
    for kv in (ref_kv, graph_kv):
        kv.step([("p", prefix)])
        for i in range(10):  # r*: p's three blocks, then their own; s*: only p's first block
            kv.block_tables[f"r{i}"] = list(kv.block_tables["p"][:3])
            kv.num_computed[f"r{i}"] = 12
            kv.block_tables[f"s{i}"] = list(kv.block_tables["p"][:1])
            kv.num_computed[f"s{i}"] = 4
        kv.step(list(own.items()))
    # (group, shared tokens named): a stale 12 on an s-step would read r0's blocks 1-2 for every row
    plan = [("r", 12), ("s", 4), ("r", 12), ("s", None), ("s", 4), ("r", 8)]
    for step, (group, shared) in enumerate(plan):
        batch = [(f"{group}{i}", [rng.randrange(3, 250)]) for i in range(10)]
        ref = ref_kv.step(batch)
        ids, positions, meta = graph_kv.build(batch)
        if shared is not None:  # None: no prefix named, the plain graph
            meta = dataclasses.replace(meta, common_prefix_len=shared,
                                       prefix_kv_lens=torch.tensor([shared], dtype=torch.int32))
        hidden, _ = runner.run(make_batch(ids, positions, meta))
        logits = graph_model.compute_logits(hidden)
        for row, (rid, _) in enumerate(batch):
            torch.testing.assert_close(logits[row:row + 1], ref[rid], atol=1e-4, rtol=1e-4, msg=f"step {step} {rid}")
        if shared is not None:
            assert runner.prefix_kv_lens.tolist() == [shared]
    assert runner.num_replays == 6 and runner.num_cascade_replays == 5


def test_fake_replay_computes_logits_in_small_buckets(tiny_dir, monkeypatch):
    """Given compute_logits, buckets up to LOGITS_MAX_BATCH capture the logits after the body (and
    cascade graphs never do): the replayed logits of the real rows equal the eager reference's, a
    step in a larger bucket returns hidden states only, and the static logits hold only small buckets."""
    import tallyserve.runner.cuda_graph as cg

    monkeypatch.setattr(cg, "LOGITS_MAX_BATCH", 4)
    ref_model, graph_model = load_tiny(tiny_dir, None), load_tiny(tiny_dir, StaticCascadeBackend())
    ref_kv = PagedKV(ref_model, num_blocks=64, block_size=4, seed=4)
    graph_kv = PagedKV(graph_model, num_blocks=64, block_size=4, seed=4)
    calls = []

    def logits_fn(hidden):
        calls.append(hidden.shape[0])
        return graph_model.compute_logits(hidden)

    runner = CudaGraphRunner(graph_model, graph_kv.kv_caches, max_num_seqs=8, max_blocks_per_seq=16,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=4,
                             graph_factory=ReplayByRerun(), cascade=True, compute_logits=logits_fn)
    runner.capture()
    assert sorted(runner.logits_outputs) == [1, 2, 4] and sorted(set(calls)) == [1, 2, 4]
    assert runner.cascade_sizes == (8,) and not runner.graph_logits(8) and not runner.graph_logits(4, cascade=True)
    assert all(t.shape == (b, 256) and t.dtype == torch.float32 for b, t in runner.logits_outputs.items())
    rng = random.Random(7)
    prompts = [(f"r{j}", [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]) for j in range(8)]
    ref_kv.step(prompts)
    graph_kv.step(prompts)
    for step, n in enumerate([3, 1, 6, 4, 2, 8, 1]):
        batch = [(rid, [rng.randrange(3, 250)]) for rid in rng.sample([rid for rid, _ in prompts], n)]
        ref = ref_kv.step(batch)
        ids, positions, meta = graph_kv.build(batch)
        hidden, logits = runner.run(make_batch(ids, positions, meta))
        if runner.bucket_for(n) > 4:
            assert logits is None
            logits = graph_model.compute_logits(hidden)
        else:
            assert logits.shape == (n, 256)
            # the graph multiplied its bucket's rows: the same product over as many rows, bit for bit (a CPU BLAS
            # may sum in another order for another row count, as MKL did for 3 rows against 4 on an AMD EPYC)
            b = runner.bucket_for(n)
            padded = torch.cat([hidden, hidden.new_zeros(b - n, hidden.shape[1])])
            torch.testing.assert_close(logits, graph_model.compute_logits(padded)[:n], atol=0, rtol=0)
        for row, (rid, _) in enumerate(batch):
            torch.testing.assert_close(logits[row:row + 1], ref[rid], atol=1e-4, rtol=1e-4, msg=f"step {step} {rid}")


def test_packed_decode_steps_reach_small_buckets_in_one_copy(tiny_dir, monkeypatch):
    """ForwardBatch.build packs a decode step in its bucket's layout (graph_layout); the runner then
    moves the whole packed region in one copy (no per-tensor copies), padding rows included; the
    replayed logits equal the eager reference's, and steps of larger buckets (or prefill) are not packed."""
    from tallyserve import SamplingParams
    from tallyserve.core.sched_output import ScheduledRequest, SchedulerOutput
    from tallyserve.runner.forward_batch import ForwardBatch

    ref_model, graph_model = load_tiny(tiny_dir, None), load_tiny(tiny_dir, StaticDecodeBackend())
    ref_kv = PagedKV(ref_model, num_blocks=64, block_size=4, seed=6)
    graph_kv = PagedKV(graph_model, num_blocks=64, block_size=4, seed=6)
    runner = CudaGraphRunner(graph_model, graph_kv.kv_caches, max_num_seqs=32, max_blocks_per_seq=16,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=4,
                             graph_factory=ReplayByRerun())
    assert runner.layout(3, 2) is None, "nothing captured yet"
    runner.capture()
    assert sorted(runner.packed) == [1, 2, 4, 8, 16] and runner.layout(17, 2) is None and runner.layout(3, 17) is None
    assert runner.layout(3, 5) == (4, 16)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a, **k: (copies.append(t.dtype), real_copy(t, src, *a, **k))[1])
    rng = random.Random(3)
    prompts = [(f"r{j}", [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]) for j in range(20)]
    ref_kv.step(prompts)
    graph_kv.step(prompts)
    params = SamplingParams(max_tokens=8)
    for step, n in enumerate([3, 1, 16, 5, 20]):
        batch = [(rid, [rng.randrange(3, 250)]) for rid in rng.sample([rid for rid, _ in prompts], n)]
        ref = ref_kv.step(batch)
        starts = {rid: graph_kv.num_computed[rid] for rid, _ in batch}
        graph_kv.build(batch)  # hands out the new slots' blocks exactly as the reference did
        so = SchedulerOutput(step_id=step, requests=tuple(
            ScheduledRequest(rid, tuple(toks), starts[rid], tuple(graph_kv.block_tables[rid]), True, params, 0)
            for rid, toks in batch), total_tokens=n)
        fb = ForwardBatch.build(so, 4, torch.device("cpu"), graph_layout=runner.layout)
        size = runner.bucket_for(n)
        assert (fb.graph_inputs is not None) == (size <= 16)
        assert runner.can_run(fb)
        copies.clear()
        hidden, _ = runner.run(fb)
        if size <= 16:
            # (the fake replay copies the float32 hidden states into the static output)
            assert [d for d in copies if d != torch.float32] == [torch.uint8], "one copy of the packed region"
            ids, pos, slots, seq_lens, tables = runner.inputs(size)
            assert ids[:n].tolist() == [t[0] for _, t in batch] and pos[:n].tolist() == list(starts.values())
            assert (slots[n:] == -1).all() and (seq_lens[n:] == 0).all()
        logits = graph_model.compute_logits(hidden)
        for row, (rid, _) in enumerate(batch):
            torch.testing.assert_close(logits[row:row + 1], ref[rid], atol=1e-4, rtol=1e-4, msg=f"step {step} {rid}")
    prefill = SchedulerOutput(step_id=9, requests=(ScheduledRequest("x", (5, 6), 0, (1, 2), True, params, 0),),
                              total_tokens=2)
    assert ForwardBatch.build(prefill, 4, torch.device("cpu"), graph_layout=runner.layout).graph_inputs is None


def test_can_run_rejects_non_decode_and_oversize(tiny_dir):
    model = load_tiny(tiny_dir, StaticDecodeBackend())
    kv = PagedKV(model, num_blocks=64, block_size=4)
    runner = CudaGraphRunner(model, kv.kv_caches, max_num_seqs=2, max_blocks_per_seq=4,
                             device=torch.device("cpu"), dtype=torch.float32, block_size=4,
                             graph_factory=ReplayByRerun())
    ids, pos, meta = kv.build([("a", [5, 6, 7])])
    assert not runner.can_run(make_batch(ids, pos, meta)), "not captured yet"
    runner.capture()
    assert not runner.can_run(make_batch(ids, pos, meta)), "prefill chunk"
    ids, pos, meta = kv.build([("a", [8]), ("b", [9, 10])])
    assert not runner.can_run(make_batch(ids, pos, meta)), "mixed batch"
    ids, pos, meta = kv.build([("a", [1]), ("b", [2]), ("c", [3])])
    assert not runner.can_run(make_batch(ids, pos, meta)), "more requests than the largest bucket"
    ids, pos, meta = kv.build([("a", [4]), ("b", [5])], num_padding=1)
    assert not runner.can_run(make_batch(ids, pos, meta)), "trailing padding rows"
    ids, pos, meta = kv.build([("a", [4]), ("b", [5])])
    assert runner.can_run(make_batch(ids, pos, meta))
    kv.build([("a", list(range(10)))])  # a reaches 16 tokens = 4 blocks
    ids, pos, meta = kv.build([("a", [4])])
    assert not runner.can_run(make_batch(ids, pos, meta)), "block table wider than captured"
    assert runner.bucket_for(1) == 1 and runner.bucket_for(2) == 2


def test_model_runner_stays_eager_on_cpu(tiny_dir):
    from tallyserve.runner.model_runner import ModelRunner

    model = load_tiny(tiny_dir, get_attn_backend("torch"))
    runner = ModelRunner(model, model.config, 16, 4, torch.device("cpu"), torch.float32, use_cuda_graph=True)
    assert runner.graph_runner is None
