"""The offline API's behaviour users rely on: argument errors before any weight loads, ledger
violations and step errors that fail only their own step, stop strings, seeds, logprobs,
priorities, aborts, and the `tallyserve generate` command; each with async scheduling too."""

from __future__ import annotations

import json

import pytest

import tallyserve.executor.uniproc as uniproc_mod
from tallyserve import LLM, SamplingParams
from tallyserve.cli import main as cli_main
from tallyserve.runner.forward_batch import ForwardBatch
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("api"), "llama")
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_sched(request):
    return request.param


@pytest.fixture(scope="module")
def llm(model_dir, async_sched):
    return LLM(model=model_dir, block_size=4, async_scheduling=async_sched)


def _free(llm):
    s = llm.stats()
    return s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize("kwargs, message", [  # each message opens with the argument it is about
    (dict(max_num_seqs=0), r"^max_num_seqs must be an integer >= 1, got 0"),
    (dict(block_size=0), r"^block_size must be an integer \[1, 1024\], got 0"),
    (dict(max_num_batched_tokens=-1), r"^max_num_batched_tokens must be an integer >= 1, got -1"),
    (dict(load_format="pickle"), r"^load_format must be one of .*, got 'pickle'"),
    (dict(dtype="int8"), r"^dtype must be one of .*, got 'int8'"),
    (dict(gpu_memory_utilization=1.5), r"^gpu_memory_utilization must be a number in \(0, 1\], got 1.5"),
    (dict(device="tpu"), r"^device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (dict(enable_prefix_caching="yes"), r"^enable_prefix_caching must be a bool, got 'yes'"),
    (dict(max_model_len=10**6), r"^max_model_len \(1000000\) is larger than the model's max_position_embeddings"),
    (dict(speculative_config={"method": "ngram"}), r"^speculative_config.num_speculative_tokens must be an integer"),
    (dict(async_scheduling="on"), r"^async_scheduling must be a bool or None, got 'on'"),
    (dict(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"^async_scheduling does not support speculative decoding"),
    (dict(not_an_arg=1), "unknown engine argument"),
])
def test_bad_engine_args_fail_before_weights_load(model_dir, monkeypatch, kwargs, message):
    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the arguments were validated")

    monkeypatch.setattr(uniproc_mod, "load_model", no_load)
    with pytest.raises(ValueError, match=message):
        LLM(model=model_dir, **kwargs)


def test_chunked_off_needs_budget_for_whole_prompts(model_dir):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLM(model=model_dir, enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64)


def test_ledger_mismatch_fails_only_that_step(model_dir, monkeypatch, async_sched):
    llm = LLM(model=model_dir, async_scheduling=async_sched, block_size=4)
    real_build = ForwardBatch.build
    calls = {"n": 0}

    def bad_build(so, block_size, device, placeholder_src=None, **kw):
        batch = real_build(so, block_size, device, placeholder_src, **kw)
        calls["n"] += 1
        if calls["n"] == 2:  # the forward pass would compute one token more than was charged
            object.__setattr__(batch, "num_tokens", batch.num_tokens + 1)
        return batch

    monkeypatch.setattr(ForwardBatch, "build", staticmethod(bad_build))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0]
    assert first.outputs[0].finish_reason == "error" and "ledger mismatch" in first.error
    later = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0]
    assert later.outputs[0].finish_reason == "length" and len(later.outputs[0].token_ids) == 5
    s = llm.stats()
    assert s["ledger_violations"] == 1 and s["forward_tokens"] == s["scheduled_tokens"] + 1
    assert _free(llm)


def test_step_exception_fails_only_its_requests(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def boom(so):
        llm.engine.fault_injector = None
        raise RuntimeError("injected fault")

    llm.engine.fault_injector = boom
    bad = llm.generate([{"prompt_token_ids": [9, 9, 9]}], params)[0]
    assert bad.outputs[0].finish_reason == "error" and "injected fault" in bad.error
    good = llm.generate([{"prompt_token_ids": [9, 9, 9]}], params)[0]
    assert good.outputs[0].finish_reason == "length"
    assert _free(llm)


def test_stop_string_truncates_text(llm):
    base = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    text = base.outputs[0].text
    assert len(text) >= 4
    stop = text[2:4]
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                             stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert _free(llm)


def test_seeds_n_and_logprobs(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, n=3, logprobs=2, ignore_eos=True)
    a = llm.generate("hello", params)[0]
    b = llm.generate("hello", params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and len({tuple(c.token_ids) for c in a.outputs}) > 1
    comp = a.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, entry in zip(comp.token_ids, comp.logprobs):
        assert tok in entry and len(entry) in (2, 3)
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))


def test_priority_orders_admission(model_dir, async_sched):
    llm = LLM(model=model_dir, max_num_seqs=1, block_size=4, async_scheduling=async_sched)
    order = []
    llm.engine.fault_injector = lambda so: order.extend(e.request_id for e in so.requests if e.start_position == 0)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(3)]
    llm.generate(prompts, params, priority=[5, 0, 1])
    assert order == ["1", "2", "0"]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("x")
    outs = engine.step()
    assert outs and outs[0].outputs[0].finish_reason == "abort" and outs[0].finished
    assert not engine.has_unfinished_requests() and _free(llm)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "non-empty"),
    ({"prompt_token_ids": [1, 10**6]}, "out of range"),
    ({"prompt_token_ids": list(range(100)) * 30}, "max_model_len"),
    ({"text": "x"}, "prompt_token_ids"),
    (3.5, "prompt must be"),
])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests() and _free(llm)


def test_cli_generate(model_dir, capsys):
    rc = cli_main(["generate", "--model", model_dir, "Hello there", "--max-tokens", "4", "--json", "--ignore-eos"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["prompt"] == "Hello there" and len(rec["token_ids"]) == 4 and rec["finish_reason"] == "length"
    assert cli_main(["generate", "--model", model_dir, "hi", "--block-size", "0"]) == 2


def test_device_auto_follows_tallyserve_device(monkeypatch):
    from tallyserve.config.device import resolve_device

    monkeypatch.setenv("TALLYSERVE_DEVICE", "cpu")
    assert resolve_device("auto").type == "cpu"
    monkeypatch.setenv("TALLYSERVE_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TALLYSERVE_DEVICE"):
        resolve_device("auto")
    assert resolve_device("cpu").type == "cpu"  # an explicit device ignores it


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = {"prompt_token_ids": [12, 200, 31, 9, 77, 140, 66, 21]}
    toks = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    cut = next(i for i in range(1, 8) if toks[i] not in toks[:i])
    stop = toks[cut]
    early = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                stop_token_ids=[stop]))[0].outputs[0]
    assert early.token_ids == toks[: cut + 1] and early.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
                                               min_tokens=cut + 2))[0].outputs[0]
    assert stop not in held.token_ids[: cut + 2] and len(held.token_ids) >= cut + 2
    assert held.token_ids[:cut] == toks[:cut] and held.finish_reason in ("stop", "length")
    assert _free(llm)
