"""Grammars over the tokenizer's vocabulary when the model's logits are wider: the bitmask rows are the
tokenizer's width, the logits past it are forbidden, and every answer equals the one compiled over the
whole logits width (where xgrammar tracks each padding id as a special token); stop ids the tokenizer does
not know (a borrowed tokenizer) are left to the engine, not the grammar."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from tallyserve import LLM, SamplingParams, StructuredOutputsParams
from tallyserve.structured_output import manager as manager_mod
from tests.model.test_structured_outputs import CHOICES, PERSON, PROMPTS, _check_ledger
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("wide_vocab"), "llama", vocab_size=640)  # 384 padding ids
    make_tiny_tokenizer(path, vocab_size=256)
    return path


def _run(path, **kw):
    llm = LLM(model=path, block_size=4, **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-e]{2,5}!"))]
    return llm, llm.generate(PROMPTS, params)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokenizer_width_grammar_equals_the_full_width_one(wide_model, monkeypatch, async_scheduling):
    llm, outs = _run(wide_model, async_scheduling=async_scheduling)
    mgr = llm.engine.structured
    assert (mgr.vocab_size, mgr.grammar_vocab_size) == (640, 256)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    assert outs[1].outputs[0].text in CHOICES
    assert re.fullmatch(r"[a-e]{2,5}!", outs[2].outputs[0].text)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert all(t < 256 for t in o.outputs[0].token_ids)  # no padding id was ever sampled
    _check_ledger(llm)
    monkeypatch.setattr(manager_mod, "grammar_vocab_size", lambda tok, vocab, eos: vocab)
    full, want = _run(wide_model, async_scheduling=async_scheduling)
    assert full.engine.structured.grammar_vocab_size == 640
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_grammar_vocab_rules():
    tok = SimpleNamespace(hf=[None] * 100)  # len() is all the rule reads
    assert manager_mod.grammar_vocab_size(tok, 128, [2]) == 100
    assert manager_mod.grammar_vocab_size(tok, 128, [120, 2]) == 100  # a stop id past the tokenizer is not the grammar's
    assert manager_mod.grammar_vocab_size(tok, 128, [120]) == 128    # no stop id inside it: the whole width
    assert manager_mod.grammar_vocab_size(tok, 100, [2]) == 100
    assert manager_mod.grammar_vocab_size(SimpleNamespace(hf=[None] * 130), 128, [2]) == 128  # tokenizer wider
    assert manager_mod.grammar_vocab_size(None, 128, [2]) == 128
