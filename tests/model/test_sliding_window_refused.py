"""A checkpoint with sliding-window attention (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``) is served
only where full attention gives the windowed model's tokens: sequences up to the window. Beyond it the engine
refuses the config before loading, instead of answering with other tokens than transformers."""

from __future__ import annotations

import pytest

from tallyserve import LLM, SamplingParams
from tallyserve.config.model import ModelConfig
from tests.tiny_models import hf_greedy, load_hf_model, make_tiny_model


def test_a_windowed_mistral_is_refused_past_its_window(tmp_path):
    path = make_tiny_model(tmp_path, "mistral", sliding_window=8)
    with pytest.raises(ValueError, match=r"^MistralForCausalLM with sliding_window=8: sliding-window attention is "
                                         r"not supported yet.*max_model_len <= 8 \(exact there\)"):
        LLM(model=path)
    with pytest.raises(ValueError, match="sliding_window=8"):
        LLM(model=path, max_model_len=9)


def test_within_the_window_tokens_equal_transformers(tmp_path):
    path = make_tiny_model(tmp_path, "mistral", sliding_window=12)
    llm = LLM(model=path, max_model_len=12)
    prompts = [[5, 17, 99, 3], [250, 7, 7, 120, 33, 8], [42]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0.0))
    want = hf_greedy(load_hf_model(path), prompts, llm.engine.eos_token_ids, 6)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("cfg,window", [
    (dict(model_type="mistral", sliding_window=4096), 4096),
    (dict(model_type="mistral", sliding_window=None), None),
    (dict(model_type="qwen2", sliding_window=64, use_sliding_window=False), None),
    (dict(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=1), 64),
    (dict(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=4), None),
    (dict(model_type="qwen3", sliding_window=64, layer_types=["full_attention"] * 4), None),
    (dict(model_type="qwen3", sliding_window=64, layer_types=["sliding_attention"] + ["full_attention"] * 3), 64),
    (dict(model_type="llama", sliding_window=64), None),
])
def test_which_configs_have_a_window(cfg, window):
    hf = dict(architectures=[], vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, **cfg)
    assert ModelConfig.from_hf_config(hf).sliding_window == window


def test_a_qwen2_without_use_sliding_window_loads(tmp_path):
    path = make_tiny_model(tmp_path, "qwen2", sliding_window=8, use_sliding_window=False)
    assert LLM(model=path).generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))[0].outputs
