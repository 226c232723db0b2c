"""The FP8 kernels on a CUDA GPU with FP8 tensor cores (compute capability 8.9+) against the float32 reference
arithmetic (``quantization.fp8``), at Llama-3-8B's projection shapes, and FP8 models end to end against their
dequantized twins."""

from __future__ import annotations

import pytest
import torch

from tallyserve.kernels import fp8_gemm, gemv
from tallyserve.quantization.fp8 import (
    Fp8Weight, dequantize_activation, fp8_linear, fp8_linear_reference, quantize_activation, quantize_weight,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not fp8_gemm.supported(torch.device("cuda")),
                                reason="needs a CUDA GPU with FP8 tensor cores")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (200, 96)]  # (N, K): qkv, o, gate_up, down, odd


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("mode", ["token", "group", "static"])
@pytest.mark.parametrize("m,k", [(1, 4096), (37, 4096), (300, 14336), (5, 96)])
def test_quantize_rows_matches_the_reference(mode, m, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    static = torch.tensor(0.05, device="cuda")
    if mode == "group" and k % 128:
        pytest.skip("groups of 128 columns")
    q, s = (fp8_gemm.quantize_rows(x) if mode == "token" else fp8_gemm.quantize_rows(x, group=128) if mode == "group"
            else fp8_gemm.quantize_rows(x, static_scale=static))
    rq, rs = quantize_activation(x, mode, 128, static)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # the same e4m3 values, except where x / scale falls within rounding of a tie
    assert (q.float() != rq.float()).float().mean().item() < 1e-3
    assert _rel(dequantize_activation(q, s), x) < 0.05


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 77, 512])
def test_fp8_linear_matches_the_reference(block, n, k, m):
    if block is not None and (n % 128 or k % 128):
        pytest.skip("whole 128 x 128 blocks")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    q, s = quantize_weight(w, block)
    fw = Fp8Weight(q, s, block, "group" if block else "token")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = fp8_linear(x, fw)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # one row: the GEMV keeps x in bf16 (no activation rounding); more: the activations go through e4m3 too
    ref = x.float() @ fw.dequantize().t() if m == 1 else fp8_linear_reference(x, fw, out_dtype=torch.float32)
    assert _rel(out, ref) < 1e-2
    assert _rel(out, x.float() @ w.t()) < 0.08  # and close to the unquantized product


@pytest.mark.parametrize("n,k", [(6144, 4096), (200, 96)])
def test_triton_and_scaled_mm_agree(n, k):
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    q, s = quantize_weight(w)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8_gemm.quantize_rows(x)
    a = fp8_gemm.triton_gemm(xq, xs, q, s.reshape(-1, 1), None, None, torch.bfloat16, 128)
    if k % 16 == 0 and n % 16 == 0:
        b = fp8_gemm._scaled_mm(xq, xs, q, s, None, torch.bfloat16)
        assert _rel(a, b) < 5e-3
    ref = fp8_linear_reference(x, Fp8Weight(q, s), out_dtype=torch.float32)
    assert _rel(a, ref) < 1e-2


def test_gemv_silu_mul_with_fp8_down_projection():
    k, n = 14336, 4096
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    for block in (None, (128, 128)):
        q, s = quantize_weight(w, block)
        gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        out = gemv.gemv(gate_up, q, silu_mul_input=True, scale=s, scale_block=block)
        g, u = gate_up.float()[:, :k], gate_up.float()[:, k:]
        act = (torch.nn.functional.silu(g).bfloat16().float() * u).bfloat16().float()
        ref = act @ Fp8Weight(q, s, block).dequantize().t()
        assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("fmt", ["hf-block", "ct-channel", "ct-static"])
def test_fp8_checkpoint_on_the_gpu_is_close_to_its_dequantized_twin(tmp_path, fmt):
    from tallyserve import LLM, SamplingParams
    from tests.fp8_checkpoints import write_fp8
    from tests.tiny_models import make_tiny_model

    src = make_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)
    from tests.tiny_tokenizer import make_tiny_tokenizer

    make_tiny_tokenizer(src)
    fp8_dir, ref_dir = write_fp8(src, tmp_path, fmt, block=(64, 64))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3, 41 + i, 7, 200]} for i in range(8)]
    got = LLM(model=fp8_dir, dtype="bfloat16", enforce_eager=True).generate(prompts, params)
    want = LLM(model=ref_dir, dtype="bfloat16", enforce_eager=True).generate(prompts, params)
    agree = sum(g.outputs[0].token_ids == w.outputs[0].token_ids for g, w in zip(got, want))
    assert agree >= 6, agree  # activation rounding may flip a near tie


# ----------------------------------------------------------------------------- kv_cache_dtype="fp8"
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_kv_writes_match_the_reference(fused):
    """The KV write (and the fused rotary + KV write) store what torch_ref.write_kv_cache stores, byte for byte."""
    from tallyserve.attention import torch_ref
    from tallyserve.kernels import fused_ops
    from tallyserve.kernels.kv_cache_write import write_kv_cache

    t, hq, hkv, d, bs, nb = 37, 8, 2, 128, 16, 12
    scales = (0.5, 0.125)
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16) * 4
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    slots[5] = -1
    got = torch.zeros(2, nb, bs, hkv, d, device="cuda", dtype=torch.float8_e4m3fn)
    want = torch.zeros_like(got)
    if fused:
        pos = torch.arange(t, device="cuda")
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
        cos, sin = (pos[:, None].float() * inv[None]).cos(), (pos[:, None].float() * inv[None]).sin()
        ref = qkv.clone()
        fused_ops.rotary_(ref[:, : hq + hkv], cos, sin)
        fused_ops.rotary_write_kv_(qkv, hq, hkv, cos, sin, got, slots, kv_scale=scales)
        k, v = ref[:, hq:hq + hkv], ref[:, hq + hkv:]
    else:
        k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        write_kv_cache(k, v, got, slots, scales)
    torch_ref.write_kv_cache(k, v, want, slots, scales)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("reqs,shared", [([(0, 300), (17, 1), (500, 33), (1000, 1), (3, 1)], 0),
                                         ([(2000, 1)] * 9, 0), ([(700, 1)] * 12, 32)])
def test_attention_over_an_fp8_cache_matches_the_reference(reqs, shared):
    """Prefill, decode (split) and cascade (a shared 512-token prefix) over an FP8 cache with scales, against the
    torch reference over the same cache."""
    import sys
    from pathlib import Path

    from tallyserve.attention import torch_ref
    from tallyserve.attention.triton_attn import paged_attention

    sys.path.insert(0, str(Path(__file__).parent))
    from test_triton_gpu import make_case

    q, k, v, cache, meta = make_case(reqs, 32, 8, 128, 16, torch.bfloat16, shared_blocks=shared)
    scales = (0.25, 0.5)
    fp8 = torch.empty(cache.shape, dtype=torch.float8_e4m3fn, device="cuda")
    fp8[0], fp8[1] = torch_ref.to_cache(cache[0], fp8.dtype, scales[0]), torch_ref.to_cache(cache[1], fp8.dtype,
                                                                                            scales[1])
    torch_ref.write_kv_cache(k, v, fp8, meta.slot_mapping, scales)
    out = paged_attention(q, fp8, meta, 128 ** -0.5, kv_scale=scales)
    ref = torch_ref.paged_attention(q.float(), fp8, meta, 128 ** -0.5, scales)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_with_fp8_weights_and_cache_agrees_with_bf16(tmp_path, kv):
    """quantization="fp8" (+ kv_cache_dtype="fp8") under CUDA graphs against the bf16 engine on the same tiny model:
    most greedy first tokens agree, the ledger is exact, and the FP8 cache has at least 1.9x the blocks."""
    from tallyserve import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    src = make_tiny_model(tmp_path, "qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64)
    make_tiny_tokenizer(src)
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3, 41 + i, 7, 200] * (1 + i)} for i in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    common = dict(model=src, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
    base = LLM(**common)
    fp8 = LLM(**common, quantization="fp8", kv_cache_dtype=kv)
    got, want = fp8.generate(prompts, params), base.generate(prompts, params)
    agree = sum(g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0] for g, w in zip(got, want))
    assert agree >= 12, agree
    s, b = fp8.stats(), base.stats()
    assert s["scheduled_tokens"] == s["forward_tokens"] and s["ledger_violations"] == 0
    if kv == "fp8":
        assert s["kv_cache_dtype"] == "float8_e4m3fn" and s["num_total_blocks"] >= 1.9 * b["num_total_blocks"]
