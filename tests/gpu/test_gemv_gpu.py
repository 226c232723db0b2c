"""The one-row projection kernel (kernels/gemv.py) on the GPU: Llama-3-8B's projections against a float64
reference and cuBLAS, and a chain of add + RMSNorm and projections launched with programmatic dependent
launch inside a CUDA graph, bit-identical to the same chain launched plainly (a projection that read
its input before the kernel that writes it had finished would differ). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tallyserve.kernels import fused_ops, gemv, pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda")


@pytest.mark.parametrize("n,k,silu", [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False),
                                      (4096, 14336, True), (128256, 4096, False), (5120, 14336, True),
                                      (1000, 72, False)])
def test_llama_shapes_match_float64_and_cublas(n, k, silu):
    g = torch.Generator(device=DEV).manual_seed(n + k)
    w = (0.02 * torch.randn(n, k, generator=g, device=DEV)).to(torch.bfloat16)
    x = torch.randn(1, 2 * k if silu else k, generator=g, device=DEV).to(torch.bfloat16)
    assert gemv.usable(x, w)
    got = gemv.gemv(x, w, silu_mul_input=silu)
    inp = fused_ops.silu_mul(x) if silu else x
    want = inp.double() @ w.double().T
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2.0 ** -7 * scale
    cublas = torch.nn.functional.linear(inp, w)
    assert (got.float() - cublas.float()).abs().max().item() <= 2.0 ** -6 * scale


def _chain(h, residual, norms, weights):
    """Layers of: add + RMSNorm -> projection -> SiLU-fused down projection (the MLP's shape)."""
    for norm_w, (up, down) in zip(norms, weights):
        x = fused_ops.add_rms_norm(h, residual, norm_w, 1e-5)
        h = gemv.gemv(gemv.gemv(x, up), down, silu_mul_input=True)
    return h


def test_dependent_launch_in_a_graph_equals_plain_launches(monkeypatch):
    if not pdl.pdl_enabled(DEV):
        pytest.skip("needs compute capability 9.0 and a Triton with grid dependency control")
    g = torch.Generator(device=DEV).manual_seed(0)
    hidden, inter, layers = 4096, 14336, 4
    norms = [(1 + 0.1 * torch.randn(hidden, generator=g, device=DEV)).to(torch.bfloat16) for _ in range(layers)]
    weights = [((0.02 * torch.randn(2 * inter, hidden, generator=g, device=DEV)).to(torch.bfloat16),
                (0.02 * torch.randn(hidden, inter, generator=g, device=DEV)).to(torch.bfloat16)) for _ in range(layers)]
    h_in = torch.zeros(1, hidden, dtype=torch.bfloat16, device=DEV)
    res_in = torch.zeros_like(h_in)
    res = torch.zeros_like(h_in)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        res.copy_(res_in)
        _chain(h_in, res, norms, weights)  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res.copy_(res_in)
        out = _chain(h_in, res, norms, weights)
    for i in range(10):
        h_in.copy_(torch.randn(1, hidden, generator=g, device=DEV))
        res_in.copy_(torch.randn(1, hidden, generator=g, device=DEV))
        graph.replay()
        got, got_res = out.clone(), res.clone()
        monkeypatch.setenv("TALLYSERVE_PDL", "0")
        plain_res = res_in.clone()
        want = _chain(h_in.clone(), plain_res, norms, weights)
        monkeypatch.delenv("TALLYSERVE_PDL")
        assert torch.equal(got, want), i
        assert torch.equal(got_res, plain_res), i
