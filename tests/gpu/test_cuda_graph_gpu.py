"""CUDA-graph decode replay on a GPU (skipped without CUDA): real graphs with the Triton backend equal eager
output, and an engine run with graphs gives the same greedy tokens as enforce_eager and Hugging Face, with an
exact ledger; cascade attention and async scheduling likewise. The CPU part (a fake graph factory) is
test_cuda_graph.py.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu, for graph_helpers
from graph_helpers import load_tiny, make_batch  # noqa: E402
from tiny_models import PagedKV, load_hf_model  # noqa: E402

from tallyserve.attention.backend import get_attn_backend  # noqa: E402
from tallyserve.runner.cuda_graph import CudaGraphRunner  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _to(meta, device):
    import dataclasses

    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device),
                               query_start_loc=meta.query_start_loc.to(device), seq_lens=meta.seq_lens.to(device),
                               block_tables=meta.block_tables.to(device))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(tiny_dir, dtype):
    dev = torch.device("cuda")
    model = load_tiny(tiny_dir, get_attn_backend("triton"), "cuda", dtype)
    kv = PagedKV(model, num_blocks=128, block_size=16, seed=0, dtype=dtype)
    kv.kv_caches = [c.to(dev) for c in kv.kv_caches]
    runner = CudaGraphRunner(model, kv.kv_caches, max_num_seqs=16, max_blocks_per_seq=32, device=dev,
                             dtype=dtype, block_size=16, max_seq_len=512)
    runner.capture()
    rng = random.Random(1)
    reqs = [f"r{i}" for i in range(11)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        ids, pos, meta = kv.build([(r, [rng.randrange(3, 250) for _ in range(rng.randint(1, 40))]) for r in reqs])
        model(ids.to(dev), pos.to(dev), kv.kv_caches, _to(meta, dev))
        for n in (11, 3, 16, 1, 7):
            if n > len(reqs):  # admit more requests (eager prefill) so that a batch of n exists
                new = [f"s{i}" for i in range(n - len(reqs))]
                reqs += new
                new_ids, new_pos, m = kv.build([(r, [7, 8]) for r in new])
                model(new_ids.to(dev), new_pos.to(dev), kv.kv_caches, _to(m, dev))
            batch = [(r, [rng.randrange(3, 250)]) for r in rng.sample(reqs, n)]
            ids, pos, meta = kv.build(batch)
            fb = make_batch(ids.to(dev), pos.to(dev), _to(meta, dev))
            assert runner.can_run(fb)
            snapshot = [c.clone() for c in kv.kv_caches]
            graph_hidden = runner.run(fb)[0].clone()
            graph_caches = [c.clone() for c in kv.kv_caches]
            for c, s in zip(kv.kv_caches, snapshot):
                c.copy_(s)
            eager_hidden = model(fb.input_ids, fb.positions, kv.kv_caches, fb.attn_meta)
            torch.testing.assert_close(graph_hidden, eager_hidden, atol=tol, rtol=tol)
            for a, b in zip(graph_caches, kv.kv_caches):
                # the same slots written (NaN elsewhere); values equal up to rounding: the graph was
                # captured with a larger max_seq_len bound, so its decode split count differs
                assert torch.equal(a.isnan(), b.isnan())
                torch.testing.assert_close(a.nan_to_num(0), b.nan_to_num(0), atol=tol, rtol=tol)
    assert runner.num_replays == 5


@cuda
def test_engine_with_cuda_graphs_matches_eager_and_hf(tiny_dir):
    from tallyserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for eager, async_sched in ((True, False), (False, False), (False, True)):
        llm = LLM(model=tiny_dir, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=8,
                  async_scheduling=async_sched)
        assert llm.engine.runner.model.attn_backend.name == "triton"
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[eager, async_sched] = [o.outputs[0].token_ids for o in outs]
        s = llm.stats()
        assert s["scheduled_tokens"] == s["forward_tokens"] > 0
        assert s["ledger_violations"] == 0 and s["step_errors"] == 0
        assert s["async_steps"] == (s["steps"] if async_sched else 0)
        graph_runner = llm.engine.runner.graph_runner
        if eager:
            assert graph_runner is None
        else:
            assert graph_runner is not None and graph_runner.num_replays > 0
            assert sorted(graph_runner.logits_outputs) == [1, 2, 4, 8], "small buckets compute the logits"
    assert runs[True, False] == runs[False, False] == runs[False, True]
    hf = load_hf_model(tiny_dir)
    for p, toks in zip(prompts, runs[False, True]):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
        assert toks == ref[0, len(p):].tolist()


@cuda
def test_cascade_attention_engine_matches_plain_and_hf(tiny_dir):
    """Twelve prompts behind one 304-token prefix (prefix caching shares its blocks): decode steps
    attend the prefix once for all requests (cascade), in CUDA graphs and eagerly; the tokens equal
    per-request attention's (disable_cascade_attn) and Hugging Face's, and the ledger is exact."""
    from tallyserve import LLM, SamplingParams

    rng = random.Random(5)
    prefix = [rng.randrange(3, 250) for _ in range(304)]
    prompts = [prefix + [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for eager, cascade in ((False, True), (True, True), (False, False)):
        llm = LLM(model=tiny_dir, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=16,
                  disable_cascade_attn=not cascade)
        llm.generate([{"prompt_token_ids": prefix + [9]}], SamplingParams(max_tokens=1))  # cache the prefix
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[eager, cascade] = [o.outputs[0].token_ids for o in outs]
        s = llm.stats()
        assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
        graph_runner = llm.engine.runner.graph_runner
        if not eager:
            assert (graph_runner.num_cascade_replays > 0) == cascade, graph_runner.num_cascade_replays
    assert runs[False, True] == runs[True, True] == runs[False, False]
    hf = load_hf_model(tiny_dir)
    for p, toks in zip(prompts[:4], runs[False, True]):
        ids = torch.tensor([p])
        with torch.no_grad():  # greedy by hand: ignore_eos keeps EOS as a token, generate() would not emit it
            for _ in range(12):
                ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], 1)
        assert toks == ids[0, len(p):].tolist()


@cuda
def test_async_scheduling_on_gpu_matches_sync(tiny_dir):
    """Seeded sampling, logprobs, n > 1, stop tokens and chunked prefill: async scheduling on the
    GPU (tokens fed back on the device, results read through pinned memory) gives what sync does."""
    from tallyserve import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0 if i % 2 else 0.9, seed=i, n=1 + i % 2,
                             logprobs=2, ignore_eos=True, stop_token_ids=[7 + i]) for i in range(10)]
    runs = {}
    for async_sched in (False, True):
        llm = LLM(model=tiny_dir, device="cuda", dtype="float32", max_num_seqs=8, block_size=4,
                  max_num_batched_tokens=32, async_scheduling=async_sched)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[async_sched] = [[(c.token_ids, c.finish_reason, [sorted(d) for d in c.logprobs]) for c in o.outputs]
                             for o in outs]
        s = llm.stats()
        assert s["scheduled_tokens"] == s["forward_tokens"] and s["num_free_blocks"] == s["num_total_blocks"]
    assert runs[False] == runs[True]


@cuda
def test_async_step_launch_never_waits_for_the_device(tiny_dir):
    """Async scheduling only overlaps if launching a step (batch upload, placeholder fill, graph
    replay, lm_head, sampling with every filter, logprobs, the copy back) never synchronizes. Every
    decode-step launch runs under torch's sync debug mode "error": a synchronizing call raises, fails
    that step and shows up in step_errors."""
    from tallyserve import LLM, SamplingParams

    llm = LLM(model=tiny_dir, device="cuda", dtype="float32", max_num_seqs=8, block_size=4, async_scheduling=True)
    engine = llm.engine
    launch = engine.core._launch
    checked = []

    def strict_launch(so, scheduled):
        if all(e.num_tokens == 1 for e in so.requests):  # decode steps (prefill may grow the allocator)
            checked.append(so.step_id)
            torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(so, scheduled)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    engine.core._launch = strict_launch
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6, logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": [5 + i, 9, 30, 7]} for i in range(4)], params)
    s = llm.stats()
    assert s["step_errors"] == 0 and len(checked) >= 8
    assert all(o.outputs[0].finish_reason in ("length", "stop") for o in outs)
    assert all(len(o.outputs[0].token_ids) >= 6 for o in outs)
