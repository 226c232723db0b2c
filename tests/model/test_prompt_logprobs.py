"""Prompt logprobs (vLLM's prompt_logprobs) through the whole engine on tiny random float32 models:
every prompt position's logprob, full-vocabulary rank and top-k equal transformers' log_softmax of
the same weights, with chunked prefill, a prefix-cache hit on offer, preemption, mixed batches and
async scheduling; the ledger stays exact and no KV block leaks."""

from __future__ import annotations

import pytest
import torch

from tallyserve import LLM, SamplingParams
from tallyserve.core.prefix_cache import ROOT_HASH, hash_block
from tallyserve.runner import prompt_logprobs as plp
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

ATOL = 1e-4
PROMPTS = [
    [12, 200, 31, 9, 77, 140, 66, 21, 5, 18, 250, 3, 99, 42, 7, 130, 61, 8, 190, 44, 17],  # 21 tokens
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 100, 101, 102],  # 15 tokens
    [33, 34],
    [77],
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    """(model dir, reference: prompt -> transformers' log_softmax rows (len, vocab))."""
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp(f"plp-{request.param}"), request.param, seed=5)
    make_tiny_tokenizer(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def reference(prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in cache:
            with torch.no_grad():
                cache[key] = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        return cache[key]

    return path, reference


def check_against_reference(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """One entry per prompt token, None first; each holds the prompt token (its logprob and its rank
    in the whole vocabulary) and the k most likely tokens with ranks 1..k, all equal to ``ref``."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, tid = prompt_logprobs[i], ref[i - 1], prompt[i]
        assert entry is not None, f"position {i} has no entry"
        want = row[tid].item()
        assert abs(entry[tid].logprob - want) <= ATOL, (i, entry[tid].logprob, want)
        # the rank, ties within the tolerance aside
        lo, hi = int((row > want + ATOL).sum()) + 1, int((row > want - ATOL).sum()) + 1
        assert lo <= entry[tid].rank <= hi, (i, entry[tid].rank, lo, hi)
        tops = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k))
        if tid in entry and entry[tid].rank > k:
            assert len(entry) == k + 1
        assert [r for r, _, _ in tops] == list(range(1, k + 1))
        ref_vals, ref_ids = row.topk(k)
        for (rank, t, lp), rv, rid in zip(tops, ref_vals.tolist(), ref_ids.tolist()):
            assert abs(lp - rv) <= ATOL and abs(lp - row[t].item()) <= ATOL
            if t != rid:  # only a tie may reorder the top-k
                assert abs(row[t].item() - rv) <= ATOL, (i, rank, t, rid)


def ledger_exact_and_no_leak(llm: LLM) -> dict:
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] > 0 and s["ledger_violations"] == 0
    assert s["step_errors"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"], "leaked KV blocks"
    llm.engine.scheduler.kv.check_integrity()
    return s


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny, budget, async_scheduling):
    path, reference = tiny
    kw = dict(max_num_batched_tokens=budget, enable_chunked_prefill=True) if budget else {}
    llm = LLM(model=path, block_size=4, async_scheduling=async_scheduling, **kw)
    k = 3
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, prompt in zip(outs, PROMPTS):
        check_against_reference(out.prompt_logprobs, prompt, reference(prompt), k)
        assert len(out.outputs[0].token_ids) == 4
    s = ledger_exact_and_no_leak(llm)
    if budget:  # the long prompts really were chunked
        assert s["steps"] > len(PROMPTS[0]) // budget


def test_prompt_logprobs_zero_is_the_prompt_token_alone(tiny):
    path, reference = tiny
    llm = LLM(model=path, block_size=4)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    check_against_reference(out.prompt_logprobs, PROMPTS[1], reference(PROMPTS[1]), 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert out.prompt_logprobs[1][PROMPTS[1][1]].decoded_token is not None  # the tokenizer's piece


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs_only(tiny):
    """A cached prefix cannot give logprobs: a prompt_logprobs request computes its whole prompt even
    when the cache holds it, and it still publishes its blocks; other requests keep their hits."""
    path, reference = tiny
    llm = LLM(model=path, block_size=4, enable_prefix_caching=True)
    prompt = PROMPTS[0]
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    first = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert first.num_cached_tokens == 0 and first.prompt_logprobs is None
    before = llm.stats()["prefix_hit_tokens"]
    scored = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, temperature=0.0,
                                                                       prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0 and llm.stats()["prefix_hit_tokens"] == before
    check_against_reference(scored.prompt_logprobs, prompt, reference(prompt), 2)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4 > 0  # the cache still serves the rest
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # a prompt_logprobs request sharing a prefix with a cached one, in one batch with one that hits it
    longer = prompt + [1, 2, 3, 4, 5]
    outs = llm.generate([{"prompt_token_ids": longer}, {"prompt_token_ids": longer}],
                        [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1), greedy])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    check_against_reference(outs[0].prompt_logprobs, longer, reference(longer), 1)
    assert outs[1].prompt_logprobs is None
    ledger_exact_and_no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_neither_duplicates_nor_loses_entries(tiny, async_scheduling):
    """A pool too small for the batch: requests are preempted mid-prefill and mid-decode and recompute;
    every prompt position still has exactly its one entry, equal to the reference."""
    path, reference = tiny
    llm = LLM(model=path, block_size=4, num_gpu_blocks_override=12, max_num_batched_tokens=8,
              enable_chunked_prefill=True, async_scheduling=async_scheduling)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][3:] + [9, 9], PROMPTS[1][::-1]]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    s = ledger_exact_and_no_leak(llm)
    assert s["preemptions"] > 0
    for out, prompt in zip(outs, prompts):
        check_against_reference(out.prompt_logprobs, prompt, reference(prompt), 2)
        assert len(out.outputs[0].token_ids) == 14
    alone = LLM(model=path, block_size=4).generate([{"prompt_token_ids": p} for p in prompts],
                                                   SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batch_with_and_without_prompt_logprobs(tiny, async_scheduling):
    path, reference = tiny
    llm = LLM(model=path, block_size=4, max_num_batched_tokens=12, enable_chunked_prefill=True,
              async_scheduling=async_scheduling)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        params = greedy.clone(prompt_logprobs=i + 1, logprobs=1) if i % 2 == 0 else greedy
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and int(out.request_id) % 2 == 0:  # complete from the first token on
                assert all(e is not None for e in out.prompt_logprobs[1:])
            if out.finished:
                final[out.request_id] = out
    alone = LLM(model=path, block_size=4).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    for i, prompt in enumerate(PROMPTS):
        out = final[str(i)]
        assert out.outputs[0].token_ids == alone[i].outputs[0].token_ids
        if i % 2 == 0:
            check_against_reference(out.prompt_logprobs, prompt, reference(prompt), i + 1)
            assert len(out.outputs[0].logprobs) == 5
        else:
            assert out.prompt_logprobs is None
    ledger_exact_and_no_leak(llm)


def test_n_children_share_one_scoring(tiny):
    path, reference = tiny
    llm = LLM(model=path, block_size=4)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3
    check_against_reference(out.prompt_logprobs, PROMPTS[0], reference(PROMPTS[0]), 1)
    s = ledger_exact_and_no_leak(llm)
    # only the first child skipped the cache: the other two reused its prompt blocks
    assert s["prefix_hit_tokens"] + s["partial_hit_tokens"] > 0


def test_max_logprobs_governs_logprobs_and_prompt_logprobs(tiny):
    path, reference = tiny
    default = LLM(model=path, block_size=4)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name} must be <= max_logprobs \(20\), got 21"):
            default.engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams(**{name: 21}))
    wide = LLM(model=path, block_size=4, max_logprobs=50)
    out = wide.generate({"prompt_token_ids": PROMPTS[1]},
                        SamplingParams(max_tokens=2, temperature=0.0, logprobs=50, prompt_logprobs=50))[0]
    check_against_reference(out.prompt_logprobs, PROMPTS[1], reference(PROMPTS[1]), 50)
    assert all(len(e) >= 50 for e in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= max_logprobs \(50\), got 51"):
        wide.engine.add_request("y", {"prompt_token_ids": [1, 2]}, SamplingParams(prompt_logprobs=51))
    ledger_exact_and_no_leak(wide)


def test_slices_bound_the_logits_of_a_long_chunk():
    """A 2048-row chunk over a 49k vocabulary: no call computes more than SLICE_ELEMENTS logits,
    and the sliced results equal one full log_softmax."""
    from tallyserve.core.sched_output import ScheduledRequest

    vocab, rows = 49152, 2048
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(8, vocab, generator=gen)
    hidden = torch.randn(rows + 1, 8, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    sizes = []

    def compute_logits(h):
        sizes.append(h.shape[0])
        return h @ head

    e = ScheduledRequest("r", tuple(range(rows + 1)), 0, (0,), True, SamplingParams(prompt_logprobs=5), 0,
                         prompt_logprob_targets=tuple(targets.tolist()))
    got = plp.compute_prompt_logprobs(compute_logits, hidden, [e], (0, rows + 1), vocab).result()["r"]
    assert max(sizes) * vocab <= plp.SLICE_ELEMENTS and sum(sizes) == rows and len(sizes) > 1
    assert got.first_index == 1 and len(got) == rows
    for i in (0, 340, 341, 1000, rows - 1):
        ref = torch.log_softmax(hidden[i] @ head, dim=-1)
        assert abs(got.logprobs[i] - ref[targets[i]].item()) <= 1e-4
        assert got.ranks[i] == int((ref > ref[targets[i]]).sum()) + 1
        assert got.top_ids[i] == ref.topk(5).indices.tolist()


def test_tensor_parallel_ranks_score_the_prompt_alike(tmp_path):
    """TP=2 (two gloo workers): every rank computes the same logits slices; rank 0 returns them."""
    import transformers

    path = make_tiny_model(tmp_path, "llama", seed=7)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                            SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
        for out, prompt in zip(outs, PROMPTS):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            check_against_reference(out.prompt_logprobs, prompt, ref, 2)
        ledger_exact_and_no_leak(llm)
    finally:
        llm.shutdown()


def test_host_tier_hit_is_skipped_for_prompt_logprobs_only(tiny):
    """Blocks evicted to the host tier serve a plain request, not one that needs the prompt's logits."""
    path, reference = tiny
    llm = LLM(model=path, block_size=4, num_gpu_blocks_override=16, max_model_len=64, kv_offload_bytes=1 << 20)
    prompt = PROMPTS[0] + [4, 5, 6]
    fillers = [[(7 * i + j) % 250 + 3 for j in range(26)] for i in range(4)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, greedy)[0]
    for pair in (fillers[:2], fillers[2:]):  # evict the prompt's blocks to the host
        llm.generate([{"prompt_token_ids": f} for f in pair], greedy)
    kv = llm.engine.scheduler.kv
    first_block = hash_block(ROOT_HASH, prompt[:4])
    assert kv.host.lookup(first_block) is not None and kv.pool.prefix_cache.lookup(first_block) is None
    before = llm.stats()["host_hit_tokens"]
    scored = llm.generate({"prompt_token_ids": prompt}, greedy.clone(prompt_logprobs=1))[0]
    assert llm.stats()["host_hit_tokens"] == before and scored.num_cached_tokens == 0
    check_against_reference(scored.prompt_logprobs, prompt, reference(prompt), 1)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids
    ledger_exact_and_no_leak(llm)
    assert llm.engine.scheduler.kv.host.num_pinned == 0


def test_speculative_decoding_leaves_prompt_logprobs_alone(tiny):
    """Draft tokens come after the first token: the prompt is scored as without speculation, and the
    generated tokens are the same."""
    path, reference = tiny
    spec = LLM(model=path, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plain = LLM(model=path, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    # the prompt holds its own greedy continuation: n-gram drafts get proposed from its first token on
    seen = plain.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0].token_ids
    prompts = [PROMPTS[0] + seen + PROMPTS[0], PROMPTS[1]]
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ref_out, prompt in zip(outs, want, prompts):
        check_against_reference(out.prompt_logprobs, prompt, reference(prompt), 2)
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
    s = ledger_exact_and_no_leak(spec)
    assert s["spec_proposed"] > 0
