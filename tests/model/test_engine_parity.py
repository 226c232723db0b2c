"""Greedy token-for-token parity of the whole engine with Hugging Face `generate`, on tiny random
Llama, Mistral, Qwen2 and Qwen3 models, under chunking, prefix reuse (full and partial blocks),
preemption and mixed n / max_tokens, with and without async scheduling. Stats prove each
mechanism really ran."""

from __future__ import annotations

import random

import pytest
import torch

from tallyserve import LLM, SamplingParams
from tallyserve.kernels import cpu_kernels
from tests.tiny_models import hf_greedy, load_hf_model, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = 12


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(37)]
    prompts = []
    for i, (share, tail) in enumerate([(0, 3), (0, 9), (13, 4), (13, 11), (21, 2), (30, 7), (37, 1), (5, 20), (0, 40)]):
        prompts.append(shared[:share] + [rng.randrange(3, 250) for _ in range(tail)])
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, tie_word_embeddings=arch == "qwen2")
    make_tiny_tokenizer(path)
    hf = load_hf_model(path)
    prompts = _prompts()
    eos = LLM(model=path, num_gpu_blocks_override=64).engine.eos_token_ids
    return path, prompts, hf_greedy(hf, prompts, eos, MAX_TOKENS)


def _run(llm: LLM, prompts, max_tokens=MAX_TOKENS, n=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _assert_parity(outs, refs, max_tokens=MAX_TOKENS):
    for out, ref in zip(outs, refs):
        for comp in out.outputs:
            assert comp.token_ids == ref[:max_tokens], (out.request_id, comp.token_ids, ref)


def _assert_ledger(llm: LLM):
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] > 0
    assert s["ledger_violations"] == 0 and s["step_errors"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    return s


def test_defaults(tiny):
    path, prompts, refs = tiny
    llm = LLM(model=path)
    _assert_parity(_run(llm, prompts), refs)
    _assert_ledger(llm)


ASYNC = pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])


@ASYNC
def test_chunked_prefill_budget_16(tiny, async_sched):
    path, prompts, refs = tiny
    llm = LLM(model=path, max_num_batched_tokens=16, block_size=4, async_scheduling=async_sched)
    _assert_parity(_run(llm, prompts), refs)
    s = _assert_ledger(llm)
    assert s["steps"] >= sum(len(p) for p in prompts) // 16
    assert s["async_steps"] == (s["steps"] if async_sched else 0)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off(tiny, caching):
    path, prompts, refs = tiny
    llm = LLM(model=path, enable_prefix_caching=caching, block_size=4)
    _assert_parity(_run(llm, prompts), refs)
    _assert_parity(_run(llm, prompts), refs)  # second pass: the prompts are cached now
    s = _assert_ledger(llm)
    if caching:
        assert s["prefix_hit_tokens"] > 0
    else:
        assert s["prefix_hit_tokens"] == 0 and s["partial_hit_tokens"] == 0


@ASYNC
def test_partial_block_reuse(tiny, async_sched):
    path, prompts, refs = tiny
    llm = LLM(model=path, block_size=8, enable_partial_reuse=True, async_scheduling=async_sched)
    _assert_parity(_run(llm, prompts[:5]), refs[:5])
    _assert_parity(_run(llm, prompts), refs)
    s = _assert_ledger(llm)
    assert s["partial_hit_tokens"] > 0


@ASYNC
def test_preemption_with_tiny_pool(tiny, async_sched):
    path, prompts, refs = tiny
    llm = LLM(model=path, block_size=4, num_gpu_blocks_override=16, max_model_len=64, async_scheduling=async_sched)
    _assert_parity(_run(llm, prompts), refs)
    s = _assert_ledger(llm)
    assert s["preemptions"] > 0


@ASYNC
def test_mixed_n_and_max_tokens(tiny, async_sched):
    path, prompts, refs = tiny
    llm = LLM(model=path, max_num_batched_tokens=32, block_size=4, async_scheduling=async_sched)
    params = [SamplingParams(max_tokens=1 + i % MAX_TOKENS, temperature=0.0, n=1 + i % 3) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ref, p in zip(outs, refs, params):
        assert len(out.outputs) == p.n
        for comp in out.outputs:
            assert comp.token_ids == ref[: p.max_tokens]
    _assert_ledger(llm)


@pytest.mark.parametrize("library", ["aten", "onednn", "sgemm"])
def test_float32_products_on_either_cpu_library_keep_parity(tiny, monkeypatch, library):
    """A float32 model on the CPU multiplies on ATen's matmul, on oneDNN's blocked weights or on tallyserve's AVX2
    kernel, whichever fits the CPU (TALLYSERVE_CPU_ONEDNN_FP32 / TALLYSERVE_CPU_SGEMM force one): every projection
    is packed for it or none is, and all keep greedy parity with transformers, through the Python layers (prompts)
    and the compiled decode layers."""
    from tallyserve.models import cpu_products

    if library == "sgemm" and not (cpu_kernels.load() and torch.ops.tallyserve_cpu.sgemm_built()):
        pytest.skip("the kernels were built without AVX2 + FMA")
    monkeypatch.setenv("TALLYSERVE_CPU_ONEDNN_FP32", "1" if library == "onednn" else "0")
    monkeypatch.setenv("TALLYSERVE_CPU_SGEMM", "1" if library == "sgemm" else "0")
    monkeypatch.setattr(cpu_products, "_onednn_f32", [])
    monkeypatch.setattr(cpu_products, "_sgemm_f32", [])
    path, prompts, refs = tiny
    llm = LLM(model=path, num_gpu_blocks_override=64)
    model = llm.engine.executor.runner.model
    projections = [model.lm_head.weight] + [w for layer in model.model.layers for w in (
        layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
        layer.mlp.down_proj.weight)]
    for attr, lib in (("mkldnn_packed", "onednn"), ("sgemm_packed", "sgemm")):
        assert [getattr(w, attr, None) is not None for w in projections] == [library == lib] * len(projections)
    _assert_parity(_run(llm, prompts), refs)
