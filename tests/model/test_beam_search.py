"""Beam search equals Hugging Face `generate(num_beams=...)` on tiny random models; beams share
prompt blocks (copy-on-write for the partial last block) and each step charges beam_width tokens."""

from __future__ import annotations

import pytest
import torch

from tallyserve import LLM, BeamSearchParams
from tests.tiny_models import load_hf_model, make_tiny_model

PROMPTS = [[5, 9, 13], list(range(20, 37)), [100, 7, 3, 9, 200, 4]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return path, load_hf_model(path)


def _hf_beams(hf, prompt, width, max_tokens, lp, eos):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                      max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                      length_penalty=lp)
    return [row[len(prompt):].tolist() for row in out]


@pytest.mark.parametrize("width, lp, engine_kw", [
    (2, 1.0, dict(block_size=4)),
    (3, 0.0, dict(block_size=8, max_num_batched_tokens=8)),
    (4, 2.0, dict(block_size=4, enable_prefix_caching=False)),
])
def test_beam_search_equals_transformers(tiny, width, lp, engine_kw):
    path, hf = tiny
    llm = LLM(model=path, **engine_kw)
    eos = list(llm.engine.eos_token_ids)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=9, length_penalty=lp))
    for prompt, out in zip(PROMPTS, outs):
        refs = _hf_beams(hf, prompt, width, 9, lp, eos)
        assert len(out.sequences) == width
        for seq, ref in zip(out.sequences, refs):
            gen = seq.tokens[len(prompt):]
            assert seq.tokens[: len(prompt)] == prompt
            assert ref[: len(gen)] == gen and all(t == eos[0] for t in ref[len(gen):]), (gen, ref)
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    llm.engine.scheduler.kv.check_integrity()


def test_beams_share_blocks_and_charge_width_per_step(tiny):
    path, _ = tiny
    llm = LLM(model=path, block_size=4)
    steps, shared = [], []

    def observe(so):
        steps.append(so.total_tokens)
        tables = [e.block_ids for e in so.requests]
        if len(tables) > 1:
            shared.append(len(set(tables[0]) & set(tables[1])))

    llm.engine.fault_injector = observe
    prompt = list(range(30, 47))  # 17 tokens: 4 full blocks + 1 partial
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert steps[0] == len(prompt)  # the prompt is computed once, not once per beam
    assert all(t == 3 for t in steps[2:])  # then beam_width tokens per step
    assert max(shared) >= 4  # the prompt's full blocks are shared by reference


def test_beam_search_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    # Once these reached beam scoring, raised OverflowError there and killed the engine loop.
    for lp in (1e308, 2000.0, -1e308, float("nan"), float("inf"), 10.5):
        with pytest.raises(ValueError, match="length_penalty must be a finite number in"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=lp)
    assert BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=-10.0).length_penalty == -10.0


@pytest.mark.parametrize("blocks, other_prompt, expect_error", [(8, 22, False), (2, 0, True)])
def test_beams_without_room_wait_or_fail_cleanly(tiny, monkeypatch, blocks, other_prompt, expect_error):
    """Forks that find no free block wait while other requests free some, and otherwise fail the
    group with a clear error: the engine itself never raises and leaks nothing."""
    from tallyserve import SamplingParams
    from tallyserve.engine import beam_search as bs

    waits = []
    real = bs.BeamGroup._blocks_needed

    def counting(self, scheduler, chosen):
        need = real(self, scheduler, chosen)
        waits.append(need > scheduler.kv.num_free_blocks)
        return need

    monkeypatch.setattr(bs.BeamGroup, "_blocks_needed", counting)
    path, _ = tiny
    llm = LLM(model=path, block_size=4, num_gpu_blocks_override=blocks, max_model_len=4 * blocks)
    engine = llm.engine
    if other_prompt:
        engine.add_request("other", {"prompt_token_ids": list(range(10, 10 + other_prompt))},
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.add_beam_search_request("beam", {"prompt_token_ids": [5, 6, 7]},
                                   BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    for _ in range(500):
        engine.step()
        if not engine.has_unfinished_requests():
            break
    beam = engine.beams.outputs.pop("beam")
    assert any(waits)
    if expect_error:
        assert beam.sequences == [] and "no free block" in beam.error
    else:
        assert len(beam.sequences) == 3 and beam.error is None
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["ledger_violations"] == 0
    engine.scheduler.kv.check_integrity()


def test_a_failed_step_with_two_beams_of_a_group_fails_the_group_once(tiny):
    llm = LLM(model=tiny[0], block_size=4)
    engine = llm.engine

    def fault(so):
        if sum("#" in e.request_id for e in so.requests) >= 2:
            raise RuntimeError("device fault")

    engine.fault_injector = fault
    engine.add_beam_search_request("g", {"prompt_token_ids": [3, 4, 5, 6, 7]},
                                   BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.beams.outputs.pop("g")
    assert out.sequences == [] and "device fault" in out.error
    s = llm.stats()
    assert s["step_errors"] == 1 and s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize("lp", [-1.0, 0.5])
def test_eos_on_the_first_step_with_any_length_penalty(tmp_path, lp):
    """An EOS candidate on a group's first step runs the stop heuristic with one generated token
    (num_generated + 1, as Hugging Face's cur_len + 1): with lp < 0 it used to compute 0 ** lp and
    fail the group with ZeroDivisionError. The result still equals transformers."""
    prompt = [5, 9, 13]
    base = make_tiny_model(tmp_path / "base", "llama", seed=3)
    eos = load_hf_model(base)(torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist()
    path = make_tiny_model(tmp_path / "eos", "llama", seed=3, eos_token_id=eos)  # same weights
    llm = LLM(model=path, block_size=4)
    assert sorted(llm.engine.eos_token_ids) == sorted(eos)  # two hypotheses end on the first step
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5,
                                                                         length_penalty=lp))[0]
    refs = _hf_beams(load_hf_model(path), prompt, 2, 5, lp, eos)
    assert len(out.sequences) == 2
    for seq, ref in zip(out.sequences, refs):
        gen = seq.tokens[len(prompt):]
        assert ref[: len(gen)] == gen and all(t == eos[0] for t in ref[len(gen):]), (gen, ref)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
