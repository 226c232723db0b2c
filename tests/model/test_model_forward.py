"""Parity of tallyserve's Llama-family model with Hugging Face transformers on tiny random models:
full prefill, chunked prefill over the paged cache, token-by-token decode, and mixed batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* and tallyserve
from tests.tiny_models import PagedKV, load_hf_model, make_tiny_model  # noqa: E402

from tallyserve.attention.metadata import output_rows_metadata  # noqa: E402
from tallyserve.models.loader import load_model, resolve_model  # noqa: E402

ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama-bias-3layers": dict(arch="llama", attention_bias=True, num_hidden_layers=3),
    "llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "llama-sharded": dict(arch="llama", max_shard_size="40KB"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(our model, HF reference logits function) for one case."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    if request.param == "llama-sharded":
        assert (Path(model_dir) / "model.safetensors.index.json").is_file()
    resolved = resolve_model(model_dir, "auto")
    ours = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, None)
    hf = load_hf_model(model_dir)

    @torch.no_grad()
    def hf_logits(tokens: list[int]) -> torch.Tensor:
        return hf(torch.tensor([tokens])).logits[0].float()

    return ours, hf_logits


def _tokens(seed: int, n: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def test_full_prefill_matches_hf(pair):
    ours, hf_logits = pair
    prompt = _tokens(1, 19)
    got = PagedKV(ours).step([("a", prompt)])["a"]
    torch.testing.assert_close(got, hf_logits(prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_hf(pair):
    ours, hf_logits = pair
    seq = _tokens(2, 17)
    ref = hf_logits(seq)
    kv = PagedKV(ours, seed=3)
    pos = 0
    for chunk in (6, 5, 2):  # prompt of 13 in three chunks, across block boundaries
        got = kv.step([("a", seq[pos:pos + chunk])])["a"]
        torch.testing.assert_close(got, ref[pos:pos + chunk], atol=ATOL, rtol=0)
        pos += chunk
    for _ in range(4):  # decode: one token per step
        got = kv.step([("a", seq[pos:pos + 1])])["a"]
        torch.testing.assert_close(got, ref[pos:pos + 1], atol=ATOL, rtol=0)
        pos += 1


def test_mixed_batch_matches_hf(pair):
    """Prefills of different lengths, a chunked prefill and decode rows in the same forward,
    with trailing padding rows (slot -1)."""
    ours, hf_logits = pair
    seqs = {"a": _tokens(4, 12), "b": _tokens(5, 15), "c": _tokens(6, 9)}
    refs = {r: hf_logits(s) for r, s in seqs.items()}
    kv = PagedKV(ours, seed=5)
    done = {"a": 0, "b": 0, "c": 0}

    def run(plan: dict[str, int], num_padding: int = 0) -> None:
        batch = [(r, seqs[r][done[r]:done[r] + n]) for r, n in plan.items()]
        out = kv.step(batch, num_padding=num_padding)
        for r, n in plan.items():
            torch.testing.assert_close(out[r], refs[r][done[r]:done[r] + n], atol=ATOL, rtol=0, msg=f"request {r}")
            done[r] += n

    run({"c": 7})  # c prefills alone
    run({"a": 10, "b": 6, "c": 1}, num_padding=3)  # two prefills of different lengths + a decode row
    run({"b": 9, "a": 1, "c": 1})  # b finishes its prompt in a second chunk, two decodes
    run({"a": 1})  # a decodes alone


def test_output_rows_leave_the_other_rows_out_of_the_last_layer(pair):
    """forward(..., out_rows): the hidden states of the sampled rows only (a prompt's last row, a decode row with
    two drafts after it, a decode row), matching transformers and the full forward's rows; every row's K/V is in
    the cache all the same (the caches equal the full forward's bit for bit)."""
    ours, hf_logits = pair
    seqs = {"a": _tokens(4, 12), "b": _tokens(5, 15), "c": _tokens(6, 9)}
    refs = {r: hf_logits(s) for r, s in seqs.items()}
    full, pruned = PagedKV(ours, seed=5), PagedKV(ours, seed=5)
    for kv in (full, pruned):
        kv.step([("c", seqs["c"][:6]), ("b", seqs["b"][:4])])
    batch = [("a", seqs["a"][:10]), ("b", seqs["b"][4:7]), ("c", seqs["c"][6:7])]
    keep = [1, 3, 1]
    with torch.no_grad():
        ids, positions, meta = full.build(batch, num_padding=2)
        every = ours(ids, positions, full.kv_caches, meta)
        ids, positions, meta = pruned.build(batch, num_padding=2)
        out = output_rows_metadata(meta, keep)
        some = ours(ids, positions, pruned.kv_caches, meta, out)
    assert out.rows.tolist() == [9, 10, 11, 12, 13] and some.shape == (5, every.shape[1])
    torch.testing.assert_close(some, every[out.rows], atol=1e-5, rtol=0)
    logits = ours.compute_logits(some)
    torch.testing.assert_close(logits[0], refs["a"][9], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1:4], refs["b"][4:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[4], refs["c"][6], atol=ATOL, rtol=0)
    for a, b in zip(full.kv_caches, pruned.kv_caches):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_padding_rows_leave_cache_untouched(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama")
    ours = load_model(resolve_model(model_dir), "auto")
    kv = PagedKV(ours, num_blocks=8)
    kv.step([("a", _tokens(7, 5))], num_padding=4)
    written = sum(int((~torch.isnan(c[0])).any(-1).any(-1).sum()) for c in kv.kv_caches)
    assert written == 5 * ours.config.num_hidden_layers  # exactly the 5 real slots per layer


def test_kv_cache_shape_and_logits_dtype(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3")
    ours = load_model(resolve_model(model_dir), "auto", dtype=torch.bfloat16)
    assert ours.get_kv_cache_shape(10, 16) == (2, 10, 16, 2, 32)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    kv = PagedKV(ours, dtype=torch.bfloat16)
    logits = kv.step([("a", _tokens(8, 6))])["a"]
    assert logits.dtype == torch.float32 and logits.shape == (6, 256)
    assert torch.isfinite(logits).all()


# ---- loader: resolution errors, dummy weights, presets ----


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match=r"load_format must be one of \['auto', 'safetensors', 'gguf', 'dummy'\]"):
        resolve_model(None, "pt")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama",'
                                          ' "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,'
                                          ' "num_hidden_layers": 1, "num_attention_heads": 2}')
    with pytest.raises(ValueError, match="no safetensors weights"):
        resolve_model(str(tmp_path))
    resolved = resolve_model(str(tmp_path), "dummy")
    assert resolved.tokenizer_dir is None and resolved.served_name == tmp_path.name
    with pytest.raises(ValueError, match="has no weights"):
        load_model(resolved, "safetensors")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture"):
        resolve_model(str(tmp_path), "dummy")
    with pytest.raises(ValueError, match="needs load_format='dummy'|use load_format='dummy'"):
        resolve_model("qwen3-8b", "safetensors")


def test_registry_rejects_unknown_architecture():
    from tallyserve.models.registry import get_model_class

    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM"):
        get_model_class("GPTNeoXForCausalLM")


def test_dummy_weights_deterministic(tmp_path):
    resolved = resolve_model(make_tiny_model(tmp_path, "qwen3"), "dummy")
    a = load_model(resolved, "dummy", torch.float32, "cpu", seed=7)
    b = load_model(resolved, "auto", torch.float32, "cpu", seed=7)
    c = load_model(resolved, "dummy", torch.float32, "cpu", seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.isfinite(pa).all(), name
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert (pa == 1).all(), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.015 < pa.std().item() < 0.025, name
    assert not a.training and not any(p.requires_grad for p in a.parameters())


def test_untied_config_without_lm_head_ties(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    cfg_path = Path(model_dir) / "config.json"
    cfg_path.write_text(cfg_path.read_text().replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    model = load_model(resolve_model(model_dir), "auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name,billions,checks", [
    ("llama-3-8b", 8.03, dict(vocab_size=128256, rope_theta=500000.0, num_key_value_heads=8, qk_norm=False)),
    ("mistral-nemo-12b", 12.25, dict(hidden_size=5120, num_hidden_layers=40, head_dim=128, vocab_size=131072)),
    ("qwen3-8b", 8.19, dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, qk_norm=True)),
])
def test_presets_have_real_shapes(name, billions, checks, tmp_path, monkeypatch):
    from tallyserve.models.registry import get_model_class

    monkeypatch.setenv("TALLYSERVE_CACHE_DIR", str(tmp_path))

    resolved = resolve_model(name, "dummy")
    assert resolved.served_name == name and resolved.tokenizer_dir is None and resolved.load_format == "dummy"
    assert (Path(resolved.model_dir) / "config.json").is_file()
    for field, value in checks.items():
        assert getattr(resolved.model_config, field) == value, field
    with torch.device("meta"):
        model = get_model_class(resolved.model_config.architecture)(resolved.model_config, None)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.01
