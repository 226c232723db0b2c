"""The fused MoE kernels on a CUDA GPU at the qwen3-30b-a3b and mixtral-8x7b expert shapes, many batch sizes, against
the per-expert loop (float32 reference), and a tiny mixture of experts end to end against its CPU tokens."""

from __future__ import annotations

import pytest
import torch

from tallyserve.kernels import fused_moe
from tallyserve.models.moe import FusedMoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 16, 77, 256, 2048])
def test_fused_moe_matches_the_per_expert_loop(shape, tokens):
    h, inter, experts, top_k = SHAPES[shape]
    if shape == "mixtral-8x7b" and tokens > 256:
        pytest.skip("the float32 reference of 8 x (14336 x 4096) experts over 2048 tokens is slow")
    torch.manual_seed(0)
    layer = FusedMoE(h, inter, experts, top_k, True).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in (layer.w1, layer.w3, layer.w2, layer.gate.weight):
            p.normal_(0, h ** -0.5)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    weights, ids = layer.route(x)
    ref = FusedMoE(h, inter, experts, top_k, True).to("cuda")
    with torch.no_grad():
        ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    want = ref.forward(x.float())  # the loop, float32
    layer.fuse()
    got = fused_moe.fused_moe(x, layer.w13, layer.w2, weights, ids)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 2e-2, rel


def test_tiny_moe_on_the_gpu_gives_the_cpu_tokens(tmp_path):
    from tallyserve import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path, "qwen3_moe")
    prompts = [{"prompt_token_ids": [5 + i, 17, 99, 3, 41 + i, 7, 200] * (1 + i % 3)} for i in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    gpu = LLM(model=path, device="cuda", dtype="float32").generate(prompts, params)
    cpu = LLM(model=path, device="cpu").generate(prompts, params)
    agree = sum(g.outputs[0].token_ids == c.outputs[0].token_ids for g, c in zip(gpu, cpu))
    assert agree >= 10, agree
