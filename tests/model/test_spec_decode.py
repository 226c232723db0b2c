"""Speculative decoding: greedy output equals plain decoding with both proposers, under prefix
caching, chunking and a tight budget; the ledger charges 1 + drafts and stays exact; sampling
keeps the target distribution (rejection sampling checked statistically)."""

from __future__ import annotations

import pytest
import torch

from tallyserve import LLM, SamplingParams
from tallyserve.runner.rejection_sampler import processed_probs, verify_drafts
from tallyserve.config.speculative import SpeculativeConfig
from tallyserve.spec_decode.ngram import NgramProposer
from tests.tiny_models import make_tiny_model

PROMPTS = [([5, 6, 7, 8, 9] * 8)[: 4 + 5 * i] + [11 + i] for i in range(6)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_model(root / "target", "qwen3")
    draft = make_tiny_model(root / "draft", "qwen3", num_hidden_layers=1, seed=3)
    plain = LLM(model=target).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return target, draft, [o.outputs[0].token_ids for o in plain]


def _spec_run(model, cfg, prompts, params=GREEDY, **kw):
    llm = LLM(model=model, speculative_config=cfg, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.stats()
    assert stats["scheduled_tokens"] == stats["forward_tokens"] and stats["ledger_violations"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("engine_kw", [
    dict(),
    dict(max_num_batched_tokens=7, block_size=4),  # tight budget: drafts get trimmed, prompts chunked
    dict(block_size=4, enable_prefix_caching=False),
])
@pytest.mark.parametrize("method", ["ngram", "draft_small", "draft_self"])
def test_greedy_spec_equals_plain(models, method, engine_kw):
    target, draft, want = models
    cfg = {"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else {
        "method": "draft_model", "num_speculative_tokens": 4, "model": draft if method == "draft_small" else target}
    got, stats = _spec_run(target, cfg, PROMPTS, **engine_kw)
    assert got == want
    assert stats["spec_proposed"] > 0
    if method == "draft_self":  # the target as its own draft: every draft is accepted
        assert stats["spec_accepted"] == stats["spec_proposed"]
        assert stats["spec_mean_tokens_per_step"] > 2
    if method == "ngram":  # the repetitive prompts make prompt lookup pay off
        assert stats["spec_accepted"] > 0


def test_drafts_never_overshoot_budget(models):
    target, _, want = models
    llm = LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 6},
              max_num_batched_tokens=3, block_size=4)
    seen = []
    llm.engine.fault_injector = lambda so: seen.append((so.total_tokens, max(e.num_draft_tokens for e in so.requests)))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want[:2]
    assert max(t for t, _ in seen) <= 3 and max(d for _, d in seen) >= 1


def test_rejection_sampling_keeps_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    params = SamplingParams(temperature=1.0, seed=1)
    p = processed_probs(logits, params)
    q = torch.softmax(torch.randn(2, 6), dim=-1)
    gen = torch.Generator().manual_seed(0)
    counts_point, counts_q = torch.zeros(6), torch.zeros(6)
    trials = 6000
    for _ in range(trials):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        first = verify_drafts(logits, [d, 1], params, gen, q)[0].token_id
        counts_q[first] += 1
        first = verify_drafts(logits, [2, 1], params, gen, None)[0].token_id  # point-mass draft
        counts_point[first] += 1
    for counts in (counts_q, counts_point):
        freq = counts / trials
        assert torch.allclose(freq, p[0], atol=0.025), (freq, p[0])


def test_ngram_proposer_and_config_errors():
    prop = NgramProposer(3, 1, 3)
    assert prop.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert prop.propose([9, 8, 7]) == []
    assert prop.propose([1, 1]) == [1]
    for bad, msg in [({"method": "nope", "num_speculative_tokens": 2}, r"^speculative_config.method must be one of "),
                     ({"method": "ngram", "num_speculative_tokens": 0},
                      r"^speculative_config.num_speculative_tokens must be an integer in \[1, 16\], got 0"),
                     ({"method": "draft_model", "num_speculative_tokens": 2},
                      r"^speculative_config.model \(the draft model\) is required for method 'draft_model'"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1},
                      r"^speculative_config has unknown keys \['bogus'\]"),
                     ("{not json", r"^speculative_config is not valid JSON: ")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


def test_bundled_model_spec_equals_plain():
    prompts = [[{"role": "user", "content": "Count from one to ten: one, two, three,"}],
               [{"role": "user", "content": "Repeat after me: the cat sat on the mat. the cat sat on the mat."}]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    plain = LLM(max_model_len=512)
    want = [o.outputs[0].token_ids for o in plain.chat(prompts, params)]
    spec = LLM(max_model_len=512, max_num_batched_tokens=32,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in spec.chat(prompts, params)]
    assert got == want
    s = spec.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["spec_proposed"] > 0
