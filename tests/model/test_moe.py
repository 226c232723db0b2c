"""Mixture-of-experts models on the CPU: tiny random Qwen3-MoE and Mixtral checkpoints written by transformers (per-
expert tensors, as on the Hub) against transformers itself: logits, greedy tokens under chunked prefill, prefix reuse
with partial blocks and preemption with an exact ledger, tensor parallelism over gloo with the experts split or
placed whole (``enable_expert_parallel``), routers that send every token to one expert or spread them, and the
configurations that cannot run refused before a weight loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tallyserve import LLM
from tallyserve.models.loader import load_model, resolve_model
from tallyserve.models.moe import FusedMoE
from tests.engine_checks import assert_ledger, engine, greedy
from tests.tiny_models import MOE_ARCHS, PagedKV, hf_greedy, load_hf_model, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(23)]
    return [shared[:share] + [rng.randrange(3, 250) for _ in range(tail)]
            for share, tail in [(0, 4), (23, 3), (11, 9), (23, 14), (0, 31), (6, 1)]]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
    make_tiny_tokenizer(path)
    prompts = _prompts()
    eos = LLM(model=path, num_gpu_blocks_override=64).engine.eos_token_ids
    return arch, path, prompts, hf_greedy(load_hf_model(path), prompts, eos, MAX_TOKENS)


def _run(llm: LLM, prompts) -> list[list[int]]:
    return greedy(llm, prompts, MAX_TOKENS)


def test_logits_match_transformers(tiny):
    arch, path, prompts, _ = tiny
    model = load_model(resolve_model(path), dtype=torch.float32)
    assert sum(isinstance(layer.mlp, FusedMoE) for layer in model.model.layers) == len(model.model.layers)
    hf = load_hf_model(path)
    kv = PagedKV(model, num_blocks=32, block_size=4, seed=1)
    with torch.no_grad():
        got = kv.step([("a", prompts[3]), ("b", prompts[4])])
        for rid, p in (("a", prompts[3]), ("b", prompts[4])):
            ref = hf(torch.tensor([p])).logits[0]
            assert torch.allclose(got[rid], ref, atol=1e-4, rtol=1e-4), (got[rid] - ref).abs().max()


@pytest.mark.parametrize("mechanism", ["default", "chunked16", "partial_reuse", "preemption"])
def test_greedy_tokens_equal_transformers(tiny, mechanism):
    _, path, prompts, refs = tiny
    kw = {"default": {}, "chunked16": dict(max_num_batched_tokens=16, block_size=4),
          "partial_reuse": dict(block_size=8, enable_partial_reuse=True),
          "preemption": dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64)}[mechanism]
    llm = LLM(model=path, **kw)
    assert _run(llm, prompts) == refs
    assert _run(llm, prompts[::-1]) == refs[::-1]
    s = assert_ledger(llm)
    want = {"partial_reuse": "partial_hit_tokens", "preemption": "preemptions"}.get(mechanism)
    if want:
        assert s[want] > 0
    if mechanism == "chunked16":
        assert s["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tensor_parallel_2_equals_1(tiny, expert_parallel):
    _, path, prompts, refs = tiny
    with engine(model=path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel) as llm:
        assert _run(llm, prompts) == refs
        assert_ledger(llm)


def test_expert_parallel_ranks_hold_whole_experts(tiny):
    _, path, *_ = tiny
    ranks = [load_model(resolve_model(path), tp_rank=r, tp_size=2, enable_expert_parallel=True) for r in (0, 1)]
    whole = load_model(resolve_model(path))
    for r, model in enumerate(ranks):
        moe, ref = model.model.layers[1].mlp, whole.model.layers[1].mlp
        assert moe.w1.shape[0] == 4 and torch.equal(moe.w2, ref.w2[4 * r:4 * r + 4])
        assert torch.equal(moe.gate.weight, ref.gate.weight)
    split = load_model(resolve_model(path), tp_rank=1, tp_size=2).model.layers[1].mlp
    assert split.w1.shape == (8, 16, 64) and torch.equal(split.w2, whole.model.layers[1].mlp.w2[:, :, 16:])


@pytest.mark.parametrize("router", ["one_expert", "even"])
def test_extreme_routers_match_transformers(tmp_path, router):
    """A router that sends every token to expert 5 (with one runner-up), and one whose logits are all equal (ties:
    the first experts); both as transformers computes them."""
    path = make_tiny_model(tmp_path, "qwen3_moe")
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    for name in [n for n in state if n.endswith("mlp.gate.weight")]:
        gate = torch.zeros_like(state[name])
        if router == "one_expert":
            gate[5] = 1.0
            gate[2] = 0.5
        state[name] = gate
    save_file(state, str(file))
    hf = load_hf_model(path)
    model = load_model(resolve_model(path))
    kv = PagedKV(model, num_blocks=16, block_size=4)
    prompt = [9, 8, 7, 250, 100, 3, 3, 3]
    with torch.no_grad():
        got = kv.step([("a", prompt)])["a"]
        ref = hf(torch.tensor([prompt])).logits[0]
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_dense_layers_among_sparse_ones(tmp_path):
    """Qwen3-MoE's mlp_only_layers: those layers keep a dense MLP of intermediate_size."""
    path = make_tiny_model(tmp_path, "qwen3_moe", mlp_only_layers=[0])
    model = load_model(resolve_model(path))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["GatedMLP", "FusedMoE"]
    make_tiny_tokenizer(path)
    llm = LLM(model=path)
    prompts = _prompts()[:3]
    assert _run(llm, prompts) == hf_greedy(load_hf_model(path), prompts, llm.engine.eos_token_ids, MAX_TOKENS)


def test_top_k_larger_than_the_experts(tmp_path, no_weight_reads):
    path = make_tiny_model(tmp_path, "mixtral")
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts_per_tok"] = 9
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"^num_experts_per_tok \(9\) must be between 1 and the number of experts "
                                         r"\(8\)"):
        LLM(model=path)


def test_experts_not_divisible_by_the_expert_parallel_size(tmp_path, no_weight_reads):
    path = make_tiny_model(tmp_path, "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"^enable_expert_parallel: 6 experts are not divisible by "
                                         r"tensor_parallel_size=4"):
        LLM(model=path, tensor_parallel_size=4, enable_expert_parallel=True)


def test_fp8_experts_are_refused_by_name(tmp_path):
    path = make_tiny_model(tmp_path, "mixtral")
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, str(file))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.block_sparse_moe\.experts\.3\.w2\.weight is FP8: FP8 "
                                         r"experts are not supported yet"):
        load_model(resolve_model(path))


def test_a_missing_expert_is_named(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3_moe")
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.experts.6.up_proj.weight"]
    save_file(state, str(file))
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.mlp\.w3'\]"):
        load_model(resolve_model(path))
