"""FP8 weights on the CPU: Hugging Face fp8 (block-wise, per-tensor, static activations) and compressed-tensors
float8 checkpoints (per-channel, per-tensor, block, static activations) of tiny random Llama and Qwen3 models, and
``quantization="fp8"`` on an unquantized checkpoint.

The CPU has no FP8 products, so an FP8 projection is dequantized once at load: its weights must equal, bit for bit,
the dequantized twin that ``tests/fp8_checkpoints.py`` writes with its own quantization code; the logits must match
transformers on that twin, greedy tokens must equal it, tensor parallelism over gloo must give tensor-parallel size
1's tokens, and every unsupported or broken checkpoint must be a ValueError before any weight is read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tallyserve import LLM
from tallyserve.models.loader import load_model, resolve_model
from tests.engine_checks import engine, greedy
from tests.fp8_checkpoints import FORMATS, write_fp8
from tests.tiny_models import PagedKV, load_hf_model, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

ARCHS = ["llama", "qwen3"]
PROMPTS = [[5, 17, 99, 3, 41], [250, 7, 7, 120, 33, 8, 61, 200, 14], [42]]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    src = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    make_tiny_tokenizer(src)
    return request.param, src, tmp_path_factory.mktemp(f"fp8-{request.param}")


def _weights(path: str) -> dict[str, torch.Tensor]:
    model = load_model(resolve_model(path), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _greedy(llm: LLM) -> list[list[int]]:
    return greedy(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_checkpoint_loads_as_its_dequantized_weights(tiny, fmt):
    arch, src, out = tiny
    fp8_dir, ref_dir = write_fp8(src, out, fmt)
    got, want = _weights(fp8_dir), _weights(ref_dir)
    assert got.keys() == want.keys()  # no scales left: a plain float32 model
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name
    # and the source's weights are not what it loaded: the projections really went through FP8
    src_w = _weights(src)
    assert not torch.equal(src_w["model.layers.0.mlp.down_proj.weight"], got["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("fmt", ["hf-block", "ct-channel", "ct-static"])
def test_logits_match_transformers_on_the_dequantized_twin_and_tokens_are_equal(tiny, fmt):
    arch, src, out = tiny
    fp8_dir, ref_dir = write_fp8(src, out, fmt)
    hf = load_hf_model(ref_dir)
    model = load_model(resolve_model(fp8_dir), dtype=torch.float32)
    kv = PagedKV(model, num_blocks=16, block_size=4, seed=0)
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = kv.step([("a", prompt)])["a"]  # one prefill of the whole prompt
        ref = hf(torch.tensor([prompt])).logits[0]
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (logits - ref).abs().max()
    assert _greedy(LLM(model=fp8_dir)) == _greedy(LLM(model=ref_dir))


def test_sharded_fp8_checkpoint(tiny):
    arch, src, out = tiny
    fp8_dir, ref_dir = write_fp8(src, out / "sharded", "hf-block", shards=3)
    assert len(list(Path(fp8_dir).glob("*.safetensors"))) == 3
    got, want = _weights(fp8_dir), _weights(ref_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["hf-block", "ct-channel"])
def test_tensor_parallel_2_gives_tensor_parallel_1s_tokens(tiny, fmt):
    arch, src, out = tiny
    fp8_dir, _ = write_fp8(src, out / "tp", fmt)
    with engine(model=fp8_dir, tensor_parallel_size=2) as tp2:
        assert _greedy(tp2) == _greedy(LLM(model=fp8_dir))


def test_quantization_fp8_rounds_each_output_channel(tiny, caplog):
    """quantization="fp8" on the float32 checkpoint: each projection rounded to e4m3 with one scale per output row
    (the clipping of the row's maximum that reconstructs it best), as the test's own per-channel writer with the
    same search does; a log line says what the CPU did."""
    arch, src, out = tiny
    _, ref_dir = write_fp8(src, out, "ct-channel", search=True)
    _, plain_dir = write_fp8(src, out, "ct-channel")
    assert not all(torch.equal(a, b) for a, b in zip(_weights(ref_dir).values(), _weights(plain_dir).values()))
    with caplog.at_level(logging.INFO, logger="tallyserve.models.fp8_loader"):
        model = load_model(resolve_model(src), dtype=torch.float32, quantization="fp8")
    assert "quantization='fp8' on cpu: weights rounded to FP8 e4m3" in caplog.text
    want = _weights(ref_dir)
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _greedy(LLM(model=src, quantization="fp8")) == _greedy(LLM(model=ref_dir))


def test_dummy_weights_quantize_the_same_draw(tmp_path):
    """load_format="dummy" with quantization="fp8": the unquantized model's random numbers, rounded through FP8
    (so an FP8 benchmark runs the same model as the bf16 one)."""
    src = make_tiny_model(tmp_path, "llama")
    plain = load_model(resolve_model(src), load_format="dummy", dtype=torch.float32)
    fp8 = load_model(resolve_model(src), load_format="dummy", dtype=torch.float32, quantization="fp8")
    w, q = plain.model.layers[1].mlp.up_proj.weight, fp8.model.layers[1].mlp.up_proj.weight
    assert not torch.equal(w, q)
    assert torch.allclose(w, q, rtol=0.07, atol=1e-3)  # e4m3 keeps 3 mantissa bits: <= 1/16 relative
    assert torch.equal(plain.model.embed_tokens.weight, fp8.model.embed_tokens.weight)  # embeddings stay


# ----------------------------------------------------------------------------- bad checkpoints and arguments
def _edit_config(path: str, **quant) -> None:
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {**cfg.get("quantization_config", {}), **quant}
    cfg_path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq"}, r"^quantization method 'awq' in the checkpoint's quantization_config is not supported; "
                              r"supported: fp8 .*compressed-tensors float8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]},
     r"^weight_block_size \[128, 128\] does not fit model\.layers\.0\.self_attn\.q_proj: its 64 output rows"),
    ({"quant_method": "fp8", "weight_block_size": [16]}, r"weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "static"},
     r"block-wise FP8 \(weight_block_size\) needs activation_scheme 'dynamic'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, r"only 8-bit float weights are supported"),
])
def test_unsupported_quantization_configs_fail_before_weights_load(tmp_path, quant, match, no_weight_reads):
    src = make_tiny_model(tmp_path, "llama")
    cfg_path = Path(src) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = quant
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(model=src)


def test_block_size_that_splits_a_tensor_parallel_slice(tmp_path, no_weight_reads):
    src = make_tiny_model(tmp_path, "llama")  # k/v: 32 rows, 16 per rank
    fp8_dir, _ = write_fp8(src, tmp_path, "hf-block", block=(32, 32))
    load_model(resolve_model(fp8_dir), load_format="dummy")  # fits at tensor-parallel size 1
    with pytest.raises(ValueError, match=r"^weight_block_size \[32, 32\] does not fit tensor parallelism: "
                                         r"model\.layers\.0\.self_attn\.k_proj's slice \[0, 16\) of dim 0"):
        load_model(resolve_model(fp8_dir), tp_rank=0, tp_size=2)


@pytest.mark.parametrize("value,match", [("int4", r"^quantization must be one of \['fp8'\] or None, got 'int4'"),
                                         ("FP8", r"^quantization must be one of")])
def test_bad_quantization_argument(value, match):
    with pytest.raises(ValueError, match=match):
        LLM(model="llama-3-8b", load_format="dummy", quantization=value)


def test_missing_scale_is_named(tmp_path):
    src = make_tiny_model(tmp_path, "llama")
    fp8_dir, _ = write_fp8(src, tmp_path, "ct-channel")
    file = Path(fp8_dir) / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(state, str(file))
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight_scale'\]"):
        load_model(resolve_model(fp8_dir))


def test_full_precision_weight_in_an_fp8_checkpoint(tmp_path):
    src = make_tiny_model(tmp_path, "llama")
    fp8_dir, _ = write_fp8(src, tmp_path, "hf-block")
    file = Path(fp8_dir) / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.0.self_attn.o_proj.weight"] = state["model.layers.0.self_attn.o_proj.weight"].float()
    save_file(state, str(file))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.o_proj\.weight is F32 in a checkpoint whose "
                                         r"quantization_config says FP8"):
        load_model(resolve_model(fp8_dir))


def test_fp8_tensor_in_an_ignored_layer(tmp_path):
    src = make_tiny_model(tmp_path, "llama")
    fp8_dir, _ = write_fp8(src, tmp_path, "ct-channel")
    _edit_config(fp8_dir, ignore=["lm_head", "model.layers.1.mlp.down_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight is FP8 in .* but the "
                                         r"quantization_config leaves it unquantized"):
        load_model(resolve_model(fp8_dir))


def test_ignored_layers_stay_in_full_precision(tmp_path):
    """A module the config ignores is read as the plain tensor the checkpoint holds for it."""
    src = make_tiny_model(tmp_path, "llama")
    fp8_dir, ref_dir = write_fp8(src, tmp_path, "ct-channel")
    name = "model.layers.1.mlp.down_proj"
    _edit_config(fp8_dir, ignore=["lm_head", name])
    file = Path(fp8_dir) / "model.safetensors"
    state = load_file(str(file))
    plain = load_file(str(Path(src) / "model.safetensors"))[f"{name}.weight"]
    state[f"{name}.weight"] = plain
    del state[f"{name}.weight_scale"]
    save_file(state, str(file))
    got = _weights(fp8_dir)
    assert torch.equal(got[f"{name}.weight"], plain)
    want = _weights(ref_dir)
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], want["model.layers.1.mlp.up_proj.weight"])
