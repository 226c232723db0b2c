"""dtype="bfloat16" on the CPU: bfloat16 projections (weights and matmuls) and a bfloat16 KV cache in a float32
model.

The reference is Hugging Face's float32 model with every nn.Linear doing what tallyserve's ``linear`` does
(input rounded to bfloat16, bfloat16 product, float32 out, bias added in float32) and its attention reading keys
and values rounded to bfloat16 (what the cache holds): greedy tokens must match token for token, and the
embedding, norms and residual stream must stay float32."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tallyserve import LLM, SamplingParams
from tallyserve.models.layers import linear
from tallyserve.config.device import resolve_dtype, resolve_matmul_dtype
from tests.tiny_models import load_hf_model, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_TOKENS = 10


def _bf16_linear_forward(self, x):
    out = F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).float()
    return out if self.bias is None else out + self.bias


def test_linear_rounds_input_and_weight_keeps_float32_out():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 48, generator=gen), torch.randn(24, 48, generator=gen), torch.randn(24, generator=gen)
    wb = w.to(torch.bfloat16)
    out = linear(x, wb, b)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x.to(torch.bfloat16), wb).float() + b)
    # the bf16 rounding is real: not the float32 product
    assert not torch.allclose(out, F.linear(x, w, b), rtol=0, atol=1e-6)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))  # same dtype: plain F.linear


def test_linear_no_rows():
    """An empty batch gives an empty product, as F.linear does (the one-to-four-row kernel takes no zero rows)."""
    w, b = torch.randn(24, 48).to(torch.bfloat16), torch.randn(24)
    out = linear(torch.empty(0, 48), w, b)
    assert out.shape == (0, 24) and out.dtype == torch.float32

def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("bfloat16", cpu) == torch.float32 and resolve_matmul_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_matmul_dtype("auto", cpu) is None
    assert resolve_dtype("float16", cpu) == torch.float16 and resolve_matmul_dtype("float16", cpu) is None
    assert resolve_dtype("bfloat16", cuda) == torch.bfloat16 and resolve_matmul_dtype("bfloat16", cuda) is None


def _attention_over_bf16_kv(original):
    def attend(module, query, key, value, *args, **kwargs):
        return original(module, query, key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float(), *args,
                        **kwargs)
    return attend


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # untied; tied + q/k/v bias; q/k norm
def test_bf16_projections_greedy_parity(tmp_path, arch, monkeypatch):
    import importlib

    path = make_tiny_model(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen2")
    make_tiny_tokenizer(path)
    hf = load_hf_model(path)  # eager attention
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _bf16_linear_forward.__get__(module)
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    monkeypatch.setattr(modeling, "eager_attention_forward", _attention_over_bf16_kv(modeling.eager_attention_forward))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 17, 40, 9)]

    llm = LLM(model=path, dtype="bfloat16", max_num_batched_tokens=32)  # chunked: prompts split across steps
    eos = llm.engine.eos_token_ids
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=list(eos), pad_token_id=eos[0])[0, len(p):].tolist()
        if eos[0] in ref:
            ref = ref[: ref.index(eos[0]) + 1]
        assert out.outputs[0].token_ids == ref, (arch, p)

    model = llm.engine.executor.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.float32  # a tied lm_head got its own copy
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert all(c.dtype == torch.bfloat16 for c in llm.engine.executor.runner.kv_caches)
    s = llm.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] > 0 and s["ledger_violations"] == 0


def test_draft_model_gets_bf16_projections(tmp_path):
    """The draft model follows dtype="bfloat16" too: the target as its own draft then proposes exactly what the
    target verifies (every draft accepted), and greedy output equals plain bf16 decoding."""
    target = make_tiny_model(tmp_path / "target", "qwen3")
    prompts = [([5, 6, 7, 8, 9] * 8)[: 4 + 5 * i] + [11 + i] for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=target, dtype="bfloat16").generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(model=target, dtype="bfloat16",
              speculative_config={"method": "draft_model", "num_speculative_tokens": 4, "model": target})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == plain
    s = llm.stats()
    assert s["spec_accepted"] == s["spec_proposed"] > 0
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    draft = llm.engine.spec.draft.model
    assert draft.lm_head.weight.dtype == torch.bfloat16
    assert draft.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert draft.model.embed_tokens.weight.dtype == torch.float32


def test_biased_mlp_logprobs_match_reference(tmp_path, monkeypatch):
    """Llama with mlp_bias (its MLP is not fused): the norm's bfloat16 output must not keep the biases, SiLU and
    the product in bfloat16; the logprobs equal the reference's (one bf16 rounding per matmul, as above)."""
    path = make_tiny_model(tmp_path / "llama", "llama", mlp_bias=True, attention_bias=True)
    make_tiny_tokenizer(path)
    hf = load_hf_model(path)
    assert hf.model.layers[0].mlp.gate_proj.bias is not None
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _bf16_linear_forward.__get__(module)
    import transformers.models.llama.modeling_llama as modeling

    monkeypatch.setattr(modeling, "eager_attention_forward", _attention_over_bf16_kv(modeling.eager_attention_forward))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 17, 40, 9)]
    llm = LLM(model=path, dtype="bfloat16", max_num_batched_tokens=32)
    eos = llm.engine.eos_token_ids
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=list(eos), pad_token_id=eos[0], output_logits=True,
                          return_dict_in_generate=True)
        ref = gen.sequences[0, len(p):].tolist()
        if eos[0] in ref:
            ref = ref[: ref.index(eos[0]) + 1]
        comp = out.outputs[0]
        assert comp.token_ids == ref, p
        ref_lp = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(gen.logits, ref)]
        got_lp = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        assert got_lp == pytest.approx(ref_lp, abs=3e-3), p


def test_packed_weights_multiply_as_the_plain_ones():
    """pack_cpu_weight attaches oneDNN's blocked copy; linear() takes it from five rows on, the plain weight
    below (gemv_bf16), with the same products as F.linear on the plain bfloat16 weight."""
    from tallyserve.models.cpu_products import pack_cpu_weight

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    if not pack_cpu_weight(w):
        pytest.skip("this PyTorch build has no oneDNN linear operators")
    assert w.mkldnn_packed is not None
    for rows in (5, 64, 300):
        x = torch.randn(rows, 64, generator=gen)
        want = F.linear(x.to(torch.bfloat16), w).float()
        got = linear(x, w)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)


def test_bf16_model_packs_the_projections_it_uses(tmp_path):
    path = make_tiny_model(tmp_path / "llama", "llama")
    make_tiny_tokenizer(path)
    model = LLM(model=path, dtype="bfloat16").engine.executor.runner.model
    layer = model.model.layers[0]
    used = [model.lm_head.weight, layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_weight, layer.mlp.down_proj.weight]
    if getattr(used[0], "mkldnn_packed", None) is None:
        pytest.skip("this PyTorch build has no oneDNN linear operators")
    assert all(getattr(w, "mkldnn_packed", None) is not None for w in used)
    assert getattr(model.model.embed_tokens.weight, "mkldnn_packed", None) is None  # float32, looked up
