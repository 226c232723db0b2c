"""Structured outputs through the whole engine on a tiny random model: every answer obeys its
constraint (JSON schema, regex, choice, EBNF, any JSON object) greedy and sampled, with async
scheduling, with n-gram speculation and under preemption; the ledger stays exact and no KV block
leaks; a grammar that does not compile fails its request; a compiling grammar holds its request
out of the scheduler without charging it anything."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from tallyserve import LLM, SamplingParams, StructuredOutputsParams
from tallyserve.config import EngineArgs
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.structured_output import compile_pool
from tallyserve.runner.grammar_mask import allowed_from_bitmask, mask_rows
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["dev", "ops"]},
    },
    "required": ["name", "age", "admin", "role"],
}
# What tool calling sends: an array of objects, each one of two shapes.
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
_WEATHER = {"type": "object", "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_weather"},
                           "arguments": {"type": "object", "required": ["city"],
                                         "properties": {"city": {"type": "string", "maxLength": 5}}}}}
_ADD = {"type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"const": "add"},
                       "arguments": {"type": "object", "required": ["a", "b"],
                                     "properties": {"a": _SMALL_INT, "b": _SMALL_INT}}}}
TOOL_CALLS = {"type": "array", "minItems": 1, "maxItems": 2, "items": {"anyOf": [_WEATHER, _ADD]}}
REGEX = r"[a-c]{2}-\d{3}"
CHOICES = ["yes", "no", "maybe not"]
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
PROMPTS = ["Hello", "The cat sat", "Numbers: 4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("structured"), "llama")
    make_tiny_tokenizer(path)
    return path


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _params(so: StructuredOutputsParams, temperature: float = 0.0, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(temperature=temperature, seed=7, structured_outputs=so, **kw)


def _check_ledger(llm) -> dict:
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]  # nothing leaked
    return s


CONFIGS = {
    "sync": dict(),
    "async": dict(async_scheduling=True),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def llm(model_dir, request):
    return LLM(model=model_dir, block_size=4, **CONFIGS[request.param])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_obeys_its_constraint(llm, temperature):
    cases = [
        (_so(json=PERSON, disable_any_whitespace=True), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (_so(json=json.dumps(TOOL_CALLS), disable_any_whitespace=True),
         lambda t: jsonschema.validate(json.loads(t), TOOL_CALLS)),
        (_so(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        (_so(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
        (_so(grammar=EBNF), lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t) or pytest.fail(t)),
    ]
    for so, check in cases:
        outs = llm.generate(PROMPTS, _params(so, temperature))
        for out in outs:
            comp = out.outputs[0]
            assert out.error is None and comp.finish_reason == "stop", (so.kind, comp)
            check(comp.text)
            assert comp.token_ids[-1] in llm.engine.eos_token_ids  # ended where the grammar may end
    s = _check_ledger(llm)
    if llm.engine.spec is not None:
        assert s["spec_proposed"] > 0


def test_json_object_is_a_json_object(model_dir):
    llm = LLM(model=model_dir, block_size=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=_so(json_object=True))
    out = llm.generate(["Hello"], params)[0].outputs[0]
    # a random model may not close its object within 60 tokens; what it wrote is a JSON prefix
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    # sampled too: an object every time, never an array, a string or a number (JSON mode's promise)
    sampled = llm.generate(["Hello"] * 16, [SamplingParams(max_tokens=12, temperature=1.0, seed=i,
                                                           structured_outputs=_so(json_object=True))
                                            for i in range(16)])
    assert all(o.outputs[0].text.lstrip().startswith("{") for o in sampled), [o.outputs[0].text for o in sampled]
    _check_ledger(llm)


def test_async_and_speculation_match_plain_greedy(model_dir):
    """Greedy answers are the same tokens whatever runs them: the matcher is exact across async
    steps and n-gram drafts are cut and verified against per-position bitmasks."""
    params = _params(_so(json=PERSON, disable_any_whitespace=True))
    want = [o.outputs[0].token_ids for o in LLM(model=model_dir, block_size=4).generate(PROMPTS, params)]
    for kw in CONFIGS.values():
        llm = LLM(model=model_dir, block_size=4, **kw)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want, kw
        _check_ledger(llm)


def test_preemption_keeps_the_matcher_exact(model_dir):
    params = _params(_so(json=PERSON, disable_any_whitespace=True))
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in LLM(model=model_dir, block_size=4).generate(prompts, params)]
    tight = LLM(model=model_dir, block_size=4, num_gpu_blocks_override=24, max_model_len=96)
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert _check_ledger(tight)["preemptions"] > 0


def test_grammar_end_finishes_the_request_even_with_ignore_eos(model_dir):
    llm = LLM(model=model_dir, block_size=4)
    out = llm.generate(["Hi"], _params(_so(choice=CHOICES), ignore_eos=True, max_tokens=50)
                       )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES
    _check_ledger(llm)


@pytest.mark.parametrize("so, field", [
    (dict(json={"type": "objec"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" |'), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error(model_dir, so, field):
    llm = LLM(model=model_dir, block_size=4)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["Hi"], _params(_so(**so)))
    _check_ledger(llm)


def _gate_compiles(monkeypatch) -> threading.Event:
    """Hold every compile's answer (in the pool's slot threads) until the returned event is set."""
    gate = threading.Event()
    real = compile_pool._finish
    monkeypatch.setattr(compile_pool, "_finish", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
    return gate


def test_engine_fails_the_request_when_its_grammar_fails(model_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=model_dir, block_size=4))
    gate = _gate_compiles(monkeypatch)  # fails after the add returned
    engine.add_request("bad", "Hi", _params(_so(regex="x{2,1}")))
    engine.add_request("good", "Hi", _params(_so(regex=REGEX)))
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["bad"].finished and "structured_outputs.regex" in outs["bad"].error
    assert outs["bad"].outputs[0].finish_reason == "error" and outs["bad"].outputs[0].token_ids == []
    assert re.fullmatch(REGEX, outs["good"].outputs[0].text)
    s = engine.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["num_free_blocks"] == s["num_total_blocks"]


def test_compiling_request_waits_outside_the_scheduler(model_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=model_dir, block_size=4))
    gate = _gate_compiles(monkeypatch)
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("g", "Numbers: 4", _params(_so(regex=REGEX)))
    while "plain" in engine.output.parents:
        engine.step()
    s = engine.stats()
    assert s["scheduled_tokens"] == len(engine.tokenizer.encode("Hello")) + 2  # nothing for "g"
    assert "g" not in engine.scheduler.requests and engine.has_unfinished_requests()
    gate.set()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.request_id == "g" and o.finished][0]
    assert re.fullmatch(REGEX, final.outputs[0].text)
    s = engine.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["num_free_blocks"] == s["num_total_blocks"]


def test_abort_while_compiling_cancels_the_compile(model_dir, monkeypatch):
    engine = LLMEngine(EngineArgs(model=model_dir, block_size=4))
    gate = _gate_compiles(monkeypatch)
    engine.add_request("g", "Hi", _params(_so(regex="z+")))
    future = engine.structured.parked["g"].future
    engine.abort_request("g")
    outs = engine.step()
    gate.set()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    with pytest.raises(compile_pool.CompileCancelledError):  # nobody waited for it any more
        future.result(10)
    assert engine.structured.stats.cancelled == 1


def test_compiles_are_cached_per_constraint(model_dir):
    llm = LLM(model=model_dir, block_size=4)
    llm.generate(PROMPTS, _params(_so(regex=REGEX)))
    stats = llm.engine.structured.stats
    assert stats.compiles == 1 and stats.cache_hits == len(PROMPTS) - 1 and stats.requests == {"regex": 3}
    llm.generate(PROMPTS[:1], _params(_so(regex=REGEX, disable_any_whitespace=True)))
    assert stats.compiles == 2


def test_whitespace_pattern_is_refused(model_dir):
    llm = LLM(model=model_dir, block_size=4)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        llm.generate(["Hi"], _params(_so(json=PERSON, whitespace_pattern=r"[ ]?")))


def test_bitmask_words_unpack_to_tokens():
    words = torch.tensor([[0b1011, -(1 << 31)], [0, 1]], dtype=torch.int32)
    assert allowed_from_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 1, 3, 63]  # sign bit
    allowed = allowed_from_bitmask(words, 40)  # bits past the vocabulary are dropped
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 3]
    assert allowed[1].nonzero().flatten().tolist() == [32]


def test_device_and_cpu_masking_agree():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, 100, generator=gen)
    a = mask_rows(logits.clone(), bitmask)  # xgrammar's CPU kernel
    b = mask_rows(logits.clone(), bitmask, cpu_kernel=False)  # the unpacking the GPU path runs
    assert torch.equal(a, b)
    assert torch.equal(torch.isfinite(b), allowed_from_bitmask(bitmask, 100))


def test_drafts_are_cut_at_the_first_rejected_token(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir, block_size=4), wait_for_grammars=True)  # admitted at once
    engine.add_request("c", "Hi", _params(_so(choice=["abc", "abd"])))
    req = engine.scheduler.requests["c"]
    mgr = engine.structured
    tok = engine.tokenizer
    a, b, c, x = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    assert mgr.trim_drafts(req, [a, b, c, x]) == [a, b, c]
    assert mgr.trim_drafts(req, [a, x, c]) == [a]
    assert mgr.trim_drafts(req, [x]) == []
    assert mgr.trim_drafts(req, [a, b]) == [a, b]  # the matcher came back to where it was
    engine.abort_request("c")
    engine.step()
