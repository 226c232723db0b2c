"""Penalties and token controls: the batched math against a plain reference, and end to end
through the engine (sync and async scheduling) against transformers and a reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tallyserve import LLM, SamplingParams
from tallyserve.runner.penalties import ProcessRow, apply_penalties, process_logits
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer


# --------------------------------------------------------------------------- reference


def ref_penalties(logits, prompt, output, presence, frequency, repetition):
    """HF RepetitionPenaltyLogitsProcessor over prompt+output, then OpenAI's formula over output."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        v = out[t]
        out[t] = v / repetition if v > 0 else v * repetition
    for t in set(output):
        c = output.count(t)
        out[t] = out[t] - presence * (c > 0) - frequency * c
    return out


def _batch(rows):
    pad = lambda seqs: torch.tensor([s + [-1] * (max(map(len, seqs), default=0) - len(s)) for s in seqs],
                                    dtype=torch.long).reshape(len(seqs), -1)
    return pad([r[0] for r in rows]), pad([r[1] for r in rows])


def test_penalty_math_matches_reference():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, generator=g) * 3
    cases = [  # prompt, output, presence, frequency, repetition
        ([1, 2, 3, 3], [4, 4, 4, 1], 0.5, 0.3, 1.3),
        ([7], [], 1.0, 1.0, 2.0),
        ([], [9, 9, 10], -0.7, 1.5, 1.0),
        ([5, 6], [6, 49, 49], 0.0, 0.0, 0.7),
        ([0, 0], [0], 2.0, -2.0, 1.1),
    ]
    prompt, output = _batch([(c[0], c[1]) for c in cases])
    got = apply_penalties(logits, prompt, output, torch.tensor([c[2] for c in cases]),
                          torch.tensor([c[3] for c in cases]), torch.tensor([c[4] for c in cases]))
    for i, c in enumerate(cases):
        torch.testing.assert_close(got[i], ref_penalties(logits[i], *c))


def test_process_logits_mixed_rows_and_untouched_rows():
    g = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab, generator=g)
    rows = [
        ProcessRow(0, SamplingParams(presence_penalty=1.0, repetition_penalty=1.5),
                   np.array([1, 2]), np.array([3, 3])),
        ProcessRow(2, SamplingParams(logit_bias={5: 10.0, 7: -3.0}, frequency_penalty=0.5),
                   np.array([]), np.array([5])),
        ProcessRow(3, SamplingParams(allowed_token_ids=[1, 2, 3], bad_words_token_ids=[[2], [8, 3]]),
                   np.array([]), np.array([8])),
    ]
    out = process_logits(logits, rows, None)
    torch.testing.assert_close(out[0], ref_penalties(logits[0], [1, 2], [3, 3], 1.0, 0.0, 1.5))
    torch.testing.assert_close(out[1], logits[1])  # a row without controls is unchanged
    biased = logits[2].clone()
    biased[5] += 10.0
    biased[7] -= 3.0
    torch.testing.assert_close(out[2], ref_penalties(biased, [], [5], 0.0, 0.5, 1.0))
    finite = torch.isfinite(out[3]).nonzero().flatten().tolist()
    assert finite == [1]  # allowed {1,2,3} minus bad word 2 minus 3 (prefix [8] matched)
    torch.testing.assert_close(out[3, 1], logits[3, 1])
    # no rows: nothing is processed (the runner then does not even call this)
    torch.testing.assert_close(process_logits(logits, [], None), logits)


# --------------------------------------------------------------------------- end to end

PROMPTS = [[12, 200, 31, 9, 77, 140, 66, 21], [5, 5, 5, 17, 17, 3], list(range(30, 50))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("penalties"), "llama")
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, model_dir):
    # small blocks and budget: chunked prefills, prefix hits (the prompts repeat), placeholders
    return LLM(model=model_dir, block_size=4, max_num_batched_tokens=16, async_scheduling=request.param)


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_repetition_penalty_matches_transformers(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    for _ in range(2):  # the second round hits the prefix cache: the history comes from cached slots
        got = _generate(llm, params)
        for prompt, toks in zip(PROMPTS, got):
            ids = torch.tensor([prompt])
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                     repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
            assert toks == want[0, len(prompt):].tolist()


def _reference_loop(hf_model, prompt, steps, presence, frequency):
    seq, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[0, -1].float()
        t = int(ref_penalties(logits, [], out, presence, frequency, 1.0).argmax())
        seq.append(t), out.append(t)
    return out


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (0.8, 0.6), (-0.5, 0.3)])
def test_greedy_presence_frequency_match_reference(llm, hf_model, presence, frequency):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency)
    got = _generate(llm, params)
    for prompt, toks in zip(PROMPTS, got):
        assert toks == _reference_loop(hf_model, prompt, 10, presence, frequency)


def test_penalties_actually_change_greedy_output(llm):
    plain = _generate(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    penal = _generate(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0))
    assert plain != penal


def test_mixed_batch_rows_do_not_leak(llm):
    """Rows with and without penalties in one batch: the plain rows equal a plain run."""
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penal = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=2.0,
                           repetition_penalty=1.5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [plain, penal, plain])
    want = _generate(llm, plain)
    assert outs[0].outputs[0].token_ids == want[0] and outs[2].outputs[0].token_ids == want[2]


def test_logit_bias_forces_token(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={"77": 100.0})
    for toks in _generate(llm, params):
        assert toks == [77] * 6


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = [3, 9, 100, 150]
    for temp in (0.0, 1.0):
        params = SamplingParams(temperature=temp, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed,
                                logprobs=1)
        for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params):
            assert set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_single_and_multi_token(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = _generate(llm, plain)
    banned = base[0][2]
    for toks in _generate(llm, plain.clone(bad_words_token_ids=[[banned]])):
        assert banned not in toks
    # a two-token word: its second token never follows its first
    a, b = base[0][3], base[0][4]
    for toks in _generate(llm, plain.clone(bad_words_token_ids=[[a, b]])):
        assert all((x, y) != (a, b) for x, y in zip(toks, toks[1:]))
    assert _generate(llm, plain.clone(bad_words_token_ids=[[a, b]]))[0] != base[0]


def _contains(toks, seq) -> bool:
    return any(tuple(toks[i:i + len(seq)]) == tuple(seq) for i in range(len(toks) - len(seq) + 1))


def _round_trips(tok, ids) -> bool:
    """Whether the text of `ids` is a bad word that tokenizes back to exactly `ids` (many of the tiny
    tokenizer's ids are partial UTF-8 bytes: alone they decode to "\ufffd", which is three other tokens)."""
    text = tok.decode(list(ids))
    return bool(text.strip()) and tok.encode(text, add_special_tokens=False) == list(ids)


@pytest.mark.parametrize("length", [1, 2], ids=["one-token-word", "two-token-word"])
def test_bad_words_strings_offline(llm, length):
    """A bad word given as a string, tokenized offline by with_bad_words_tokenized (vLLM's rule): a word the greedy
    output generated (one token, or two in a row) never appears in any output's tokens, which changes the output."""
    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = _generate(llm, params)
    ids = next((tuple(base[0][i:i + length]) for i in range(len(base[0]) - length + 1)
                if _round_trips(tok, base[0][i:i + length])), None)
    assert ids is not None, f"no {length}-token word of {base[0]} round-trips through the tokenizer"
    p = params.clone(bad_words=[tok.decode(list(ids))]).with_bad_words_tokenized(tok)
    assert ids in p.bad_words_token_ids  # the word as written is banned as these very tokens
    outs = _generate(llm, p)
    for toks in outs:
        for seq in p.bad_words_token_ids:
            assert not _contains(toks, seq), (seq, toks)
    assert outs[0] != base[0]


def test_sampling_params_validation():
    for bad in [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(repetition_penalty=float("inf")), dict(logit_bias={"x": 1}), dict(logit_bias={-1: 1}),
                dict(logit_bias={3: 101}), dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
                dict(bad_words=[""]), dict(bad_words_token_ids=[[]])]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    p = SamplingParams(logit_bias={"4": 1})
    assert p.logit_bias == {4: 1.0} and not SamplingParams().has_logits_processing


def test_engine_checks_ids_and_tokenizes_bad_words(llm):
    """Offline: token ids past the vocabulary are a ValueError at add time, and bad_words strings
    are tokenized by the engine itself (no with_bad_words_tokenized call needed)."""
    vocab = llm.engine.model_config.vocab_size
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for bad in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[0, vocab])):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=rf"^{name} token id {vocab} is out of range \[0, {vocab}\)"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, plain.clone(**bad))
    base = _generate(llm, plain)
    tok = llm.engine.tokenizer
    for t in base[0]:  # a generated token whose text tokenizes back to itself alone
        word = tok.decode([t])
        seqs = plain.clone(bad_words=[word]).with_bad_words_tokenized(tok).bad_words_token_ids
        if [t] in [list(x) for x in seqs]:
            break
    else:
        pytest.skip("no generated token round-trips through the tiny tokenizer")
    outs = _generate(llm, plain.clone(bad_words=[word]))
    assert all(t not in toks for toks in outs) and outs[0] != base[0]
