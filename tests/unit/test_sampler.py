import math

import pytest
import torch

from tallyserve.runner.sampler import Sampler, SamplerOutput, apply_top_k_top_p_min_p
from tallyserve.sampling_params import SamplingParams

V = 50


def _logits(n, v=V, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_ties_take_lowest_id():
    logits = _logits(6)
    logits[2, 7] = logits[2, 11] = 100.0  # a tie
    params = [SamplingParams(temperature=0)] * 6
    out = Sampler().sample(logits, params, [None] * 6)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 7
    assert out.top_logprobs == [None] * 6


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0), SamplingParams(temperature=1e-4, top_k=1)],
    ids=["top_k=1", "top_p tiny", "min_p=1", "tiny temp top_k=1"],
)
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = _logits(16, seed=1)
    gens = [_gen(i) for i in range(16)]
    out = Sampler(generator=_gen(99)).sample(logits, [params] * 16, gens)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_k_largest():
    logits = _logits(4)
    k = torch.tensor([1, 3, 0, -1])
    out = apply_top_k_top_p_min_p(logits, top_k=k)
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 3, V, V]
    top3 = set(logits[1].topk(3).indices.tolist())
    assert set(torch.isfinite(out[1]).nonzero().flatten().tolist()) == top3
    assert torch.equal(out[2], logits[2])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    out = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([0.8, 0.65, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(out[1]).tolist() == [False, False, True, True]  # 0.4 + 0.3 >= 0.65
    assert torch.isfinite(out[2]).all()  # top_p = 1 disables


def test_top_p_applies_after_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # after top_k=2 the survivors renormalise to 4/7 and 3/7; top_p=0.5 then keeps only the first
    out = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([2]), top_p=torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]


def test_min_p_filters_relative_to_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p_min_p(logits, min_p=torch.tensor([0.31]))  # threshold 0.155
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    out = apply_top_k_top_p_min_p(logits, min_p=torch.tensor([0.0]))
    assert torch.equal(out, logits)


def test_min_p_sampling_never_picks_filtered_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(200, 1)
    params = [SamplingParams(min_p=0.31)] * 200
    out = Sampler(generator=_gen(0)).sample(logits, params, [None] * 200)
    assert set(out.token_ids) == {0, 1}


def test_input_logits_not_modified():
    logits = _logits(3)
    before = logits.clone()
    apply_top_k_top_p_min_p(logits, torch.tensor([2, 2, 2]), torch.tensor([0.5] * 3), torch.tensor([0.1] * 3))
    Sampler().sample(logits, [SamplingParams(top_k=2, top_p=0.5, min_p=0.1)] * 3, [None] * 3)
    assert torch.equal(logits, before)


def _sample_seeded(logits, params, seeds, shared_seed):
    gens = [None if s is None else _gen(s) for s in seeds]
    return Sampler(generator=_gen(shared_seed)).sample(logits, params, gens).token_ids


def test_same_seed_same_tokens_regardless_of_batch():
    base = _logits(1, seed=5)[0]
    p = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=1234)
    # alone, over several steps
    gen = _gen(1234)
    sampler = Sampler(generator=_gen(0))
    alone = [sampler.sample(base.unsqueeze(0), [p], [gen]).token_ids[0] for _ in range(20)]
    assert len(set(alone)) > 3  # it really samples
    # in a batch with other (greedy, unseeded, differently seeded) rows, at another position
    gen = _gen(1234)
    other = SamplingParams(temperature=0.8)
    others = _logits(4, seed=9)
    batched = []
    for step in range(20):
        logits = torch.cat([others[:3], base.unsqueeze(0), others[3:]])
        params = [other, SamplingParams(temperature=0), other, p, SamplingParams(seed=7)]
        gens = [None, None, None, gen, _gen(7 + step)]
        batched.append(Sampler(generator=_gen(step)).sample(logits, params, gens).token_ids[3])
    assert batched == alone


def test_unseeded_rows_use_shared_generator_reproducibly():
    logits = _logits(8)
    params = [SamplingParams(temperature=1.0)] * 8
    a = _sample_seeded(logits, params, [None] * 8, shared_seed=3)
    b = _sample_seeded(logits, params, [None] * 8, shared_seed=3)
    assert a == b


def test_temperature_sampling_matches_distribution():
    torch.manual_seed(0)
    raw = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    expected = torch.softmax(raw / temperature, -1)
    n = 20000
    out = Sampler(generator=_gen(1)).sample(raw.repeat(n, 1), [SamplingParams(temperature=temperature)] * n, [None] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 20.5  # chi-square, 4 degrees of freedom: p < 0.0005 by chance


def test_seeded_rows_match_distribution():
    raw = torch.tensor([1.0, 0.0, -0.5])
    expected = torch.softmax(raw, -1)
    n = 3000
    gens = [_gen(i) for i in range(n)]
    out = Sampler().sample(raw.repeat(n, 1), [SamplingParams(seed=0)] * n, gens)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3).double()
    chi2 = (((counts - n * expected) ** 2) / (n * expected)).sum().item()
    assert chi2 < 15.2  # 2 degrees of freedom


def test_logprobs_are_raw_log_softmax_and_top_logprobs_sorted():
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=5, logprobs=0),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=1.0, logprobs=20),
    ]
    out = Sampler(generator=_gen(0)).sample(logits, params, [None, _gen(1), None, None])
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], ref[i, tok].item(), rel_tol=1e-5, abs_tol=1e-5)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    for i, k in [(0, 3), (3, 20)]:
        top = out.top_logprobs[i]
        assert len(top) == k
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        expect_vals, expect_ids = ref[i].topk(k)
        assert [t for t, _ in top] == expect_ids.tolist()
        assert torch.allclose(torch.tensor(values), expect_vals, atol=1e-5)
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy pick is the top entry


def test_top_logprobs_capped_at_vocab():
    logits = _logits(1, v=5)
    out = Sampler().sample(logits, [SamplingParams(logprobs=20)], [None])
    assert len(out.top_logprobs[0]) == 5


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler().sample(_logits(2), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="2-D"):
        Sampler().sample(torch.zeros(5), [SamplingParams()], [None])


def test_bf16_logits_accepted():
    out = Sampler().sample(_logits(2).bfloat16(), [SamplingParams(temperature=0)] * 2, [None] * 2)
    assert len(out.token_ids) == 2 and all(isinstance(t, int) for t in out.token_ids)


def test_filters_with_host_known_top_k_and_inactive_rows():
    """A mixed batch (rows with and without each filter) masks the same tokens whether the caller
    passes the largest top_k from the host (as the sampler does, so nothing waits on the device) or not;
    rows without a filter keep every token."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    top_k = torch.tensor([3, 0, 50, 7])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.2, 0.0])
    a = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    b = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, max_top_k=7)
    assert torch.equal(a, b)
    kept = a.isfinite().sum(dim=1).tolist()
    assert kept[0] == 3 and 1 <= kept[1] < 50 and 1 <= kept[2] < 50 and kept[3] <= 7
    none = apply_top_k_top_p_min_p(logits, torch.tensor([0, 0, 0, 0]), torch.ones(4), torch.zeros(4), max_top_k=1)
    assert torch.equal(none, logits)
