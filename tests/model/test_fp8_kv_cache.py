"""``kv_cache_dtype="fp8"`` on the CPU: K/V stored in FP8 e4m3 (divided by the layer's k_scale / v_scale), attention
in float32 over the dequantized values.

The reference is transformers with K and V rounded through e4m3 the same way before its attention (the rounding is
idempotent, so its own float32 cache does not matter): greedy tokens must equal it, and every mechanism that moves or
reuses KV blocks (chunked prefill, prefix hits, partial reuse, preemption, the host tier) must give the same tokens.
The pool holds four times a float32 cache's blocks in the same bytes."""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tallyserve import LLM
from tests.engine_checks import assert_ledger, engine, greedy
from tests.tiny_models import hf_greedy, load_hf_model, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_TOKENS = 10
FP8 = torch.float8_e4m3fn


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(29)]
    return [shared[:share] + [rng.randrange(3, 250) for _ in range(tail)]
            for share, tail in [(0, 5), (29, 3), (17, 9), (29, 12), (0, 33), (8, 1)]]


def _round_kv(arch: str, scales: dict[int, tuple[float, float]], monkeypatch) -> None:
    """transformers' eager attention with K and V rounded through e4m3 (x / scale, saturated, times scale)."""
    module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    original = module.eager_attention_forward

    def rounded(attn, query, key, value, *args, **kwargs):
        ks, vs = scales.get(attn.layer_idx, (1.0, 1.0))
        key = ((key.float() / ks).clamp(-448, 448).to(FP8).float() * ks).to(key.dtype)
        value = ((value.float() / vs).clamp(-448, 448).to(FP8).float() * vs).to(value.dtype)
        return original(attn, query, key, value, *args, **kwargs)

    monkeypatch.setattr(module, "eager_attention_forward", rounded)


def _hf_greedy(path: str, prompts, eos) -> list[list[int]]:
    return hf_greedy(load_hf_model(path), prompts, eos, MAX_TOKENS)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
    make_tiny_tokenizer(path)
    prompts = _prompts()
    eos = LLM(model=path, num_gpu_blocks_override=64).engine.eos_token_ids
    with pytest.MonkeyPatch.context() as mp:
        _round_kv(arch, {}, mp)
        refs = _hf_greedy(path, prompts, eos)
    return arch, path, prompts, refs, eos


def _run(llm: LLM, prompts) -> list[list[int]]:
    return greedy(llm, prompts, MAX_TOKENS)


def test_greedy_tokens_equal_transformers_with_fp8_rounded_kv(tiny):
    arch, path, prompts, refs, _ = tiny
    llm = LLM(model=path, kv_cache_dtype="fp8")
    assert _run(llm, prompts) == refs
    runner = llm.engine.executor.runner
    assert all(c.dtype == FP8 for c in runner.kv_caches)
    assert assert_ledger(llm)["kv_cache_dtype"] == "float8_e4m3fn"


def test_four_times_the_blocks_of_a_float32_cache(tiny):
    _, path, *_ = tiny
    fp8 = LLM(model=path, kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=1 << 20).stats()
    f32 = LLM(model=path, kv_cache_memory_bytes=1 << 20).stats()
    assert f32["kv_cache_dtype"] == "float32"
    assert fp8["num_total_blocks"] == 4 * f32["num_total_blocks"]


@pytest.mark.parametrize("mechanism", ["chunked", "prefix", "partial", "preemption", "host_tier"])
def test_block_moving_mechanisms_keep_the_tokens(tiny, mechanism):
    _, path, prompts, refs, _ = tiny
    kw = {"chunked": dict(max_num_batched_tokens=16, block_size=4),
          "prefix": dict(block_size=4),
          "partial": dict(block_size=8, enable_partial_reuse=True),
          "preemption": dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64),
          "host_tier": dict(block_size=4, num_gpu_blocks_override=16, max_model_len=64,
                            kv_offload_bytes=1 << 20)}[mechanism]
    llm = LLM(model=path, kv_cache_dtype="fp8", **kw)
    assert _run(llm, prompts) == refs
    assert _run(llm, prompts[::-1]) == refs[::-1]  # again, reversed: the first pass's blocks are cached now
    s = assert_ledger(llm)
    want = {"prefix": "prefix_hit_tokens", "partial": "partial_hit_tokens", "preemption": "preemptions",
            "host_tier": "host_blocks_offloaded"}.get(mechanism)
    if want:
        assert s[want] > 0, s


def test_checkpoint_kv_scales_are_used(tmp_path, monkeypatch):
    """k_scale / v_scale on the attention modules (as FP8 checkpoints carry them): the cache stores k / k_scale."""
    path = make_tiny_model(tmp_path, "llama")
    make_tiny_tokenizer(path)
    scales = {0: (0.0625, 0.03125), 1: (0.5, 0.25)}
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    for layer, (ks, vs) in scales.items():
        state[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(ks)
        state[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(vs)
    save_file(state, str(file))
    prompts = _prompts()
    llm = LLM(model=path, kv_cache_dtype="fp8")
    model = llm.engine.executor.runner.model
    assert [layer.self_attn.kv_scale for layer in model.model.layers] == [scales[0], scales[1]]
    got = _run(llm, prompts)
    state = {k: v for k, v in state.items() if not k.endswith(("k_scale", "v_scale"))}
    save_file(state, str(file))  # transformers does not know the scale tensors
    _round_kv("llama", scales, monkeypatch)
    assert got == _hf_greedy(path, prompts, llm.engine.eos_token_ids)


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16", None])
def test_unsupported_kv_cache_dtype(value):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got "):
        LLM(model="llama-3-8b", load_format="dummy", kv_cache_dtype=value)


def test_bad_kv_scale_in_a_checkpoint(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    file = Path(path) / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(state, str(file))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.k_scale: a KV cache scale is one positive"):
        LLM(model=path, kv_cache_dtype="fp8")


def test_tensor_parallel_2_with_an_fp8_cache(tiny):
    """Each gloo rank caches its KV heads in FP8: the same tokens as one process."""
    _, path, prompts, refs, _ = tiny
    with engine(model=path, kv_cache_dtype="fp8", tensor_parallel_size=2) as llm:
        assert _run(llm, prompts) == refs
        assert_ledger(llm)
