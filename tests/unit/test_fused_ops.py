"""The fused GPU kernels (kernels/fused_ops.py) on the CPU under Triton's interpreter: each kernel
against its torch reference, and a whole tiny model through the fused path against the plain one
(prefill, chunked prefill and decode over a paged cache). Runs in one subprocess, since Triton reads
TRITON_INTERPRET when a kernel is decorated."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")
if interpreter_too_old(triton):
    pytest.skip("Triton < 3.7's interpreter cannot run these loops under NumPy 2", allow_module_level=True)


WORKER = r'''
import json, sys, tempfile
import torch
from tallyserve.kernels import fused_ops
from tallyserve.models.layers import RMSNorm, apply_rotary
from tallyserve.models.loader import load_model, resolve_model
from tests.tiny_models import PagedKV, make_tiny_model

res = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    tag = str(dtype).split(".")[-1]
    x = torch.randn(5, 96, generator=g).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96, generator=g))
    want_res = x + r
    want = norm(want_res)
    r2 = r.clone()
    got = fused_ops.add_rms_norm(x, r2, norm.weight, 1e-5)
    res[f"add_rms_{tag}"] = [(got.float() - want.float()).abs().max().item(), (r2.float() - want_res.float()).abs().max().item()]
    got_plain = fused_ops.add_rms_norm(x, None, norm.weight, 1e-5)
    res[f"rms_{tag}"] = [(got_plain.float() - norm(x).float()).abs().max().item(), 0.0]
    qk = torch.randn(4, 6, 32, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 40]).float()
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = emb.cos(), emb.sin()
    want = apply_rotary(qk, cos, sin)
    strided = torch.zeros(4, 8, 32, dtype=dtype)  # a view inside a wider row, like q and k inside qkv
    strided[:, 1:7] = qk
    fused_ops.rotary_(strided[:, 1:7], cos, sin)
    res[f"rotary_{tag}"] = [(strided[:, 1:7].float() - want.float()).abs().max().item(),
                            strided[:, [0, 7]].abs().max().item()]
    qn, kn = RMSNorm(32, eps=1e-6).to(dtype), RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.1 * torch.randn(32, generator=g))
        kn.weight.copy_(1 - 0.1 * torch.randn(32, generator=g))
    want = torch.cat([apply_rotary(qn(qk[:, :4]), cos, sin), apply_rotary(kn(qk[:, 4:]), cos, sin)], dim=1)
    strided = torch.zeros(4, 8, 32, dtype=dtype)
    strided[:, :6] = qk
    fused_ops.qk_norm_rotary_(strided[:, :6], qn.weight, kn.weight, 4, 1e-6, cos, sin)
    res[f"qk_norm_rotary_{tag}"] = [(strided[:, :6].float() - want.float()).abs().max().item(),
                                    strided[:, 6:].abs().max().item()]
    # rotary (+ q/k norm) and the KV write in one kernel: bit-equal to the two kernels it replaces, padding
    # rows (slot -1) and the cache's other slots untouched
    from tallyserve.attention.torch_ref import write_kv_cache
    g2 = torch.Generator().manual_seed(7)  # its own draws: the inputs of the other kernels' cases stay as they were
    slots = torch.tensor([5, -1, 2, 11])  # slot 0 is nobody's: a padding row written there would show
    for norm in (False, True):
        worst = [0.0, 0.0]
        for hq, hkv in ((4, 2), (12, 4)):  # 8 heads: one program per token; 20: two, the second part masked
            qkv = torch.randn(4, hq + 2 * hkv, 32, generator=g2).to(dtype)
            want_qkv, got_qkv = qkv.clone(), qkv.clone()
            want_cache = torch.randn(2, 3, 4, hkv, 32, generator=g2).to(dtype)
            got_cache = want_cache.clone()
            if norm:
                fused_ops.qk_norm_rotary_(want_qkv[:, :hq + hkv], qn.weight, kn.weight, hq, 1e-6, cos, sin)
            else:
                fused_ops.rotary_(want_qkv[:, :hq + hkv], cos, sin)
            write_kv_cache(want_qkv[:, hq:hq + hkv], want_qkv[:, hq + hkv:], want_cache, slots)
            fused_ops.rotary_write_kv_(got_qkv, hq, hkv, cos, sin, got_cache, slots,
                                       *((qn.weight, kn.weight, 1e-6) if norm else ()))
            worst = [max(worst[0], (got_qkv.float() - want_qkv.float()).abs().max().item()),
                     max(worst[1], (got_cache.float() - want_cache.float()).abs().max().item())]
        res[f"rotary_write_kv{'_norm' if norm else ''}_{tag}"] = worst
    gu = torch.randn(3, 2 * 70, generator=g).to(dtype)
    want = torch.nn.functional.silu(gu[:, :70]) * gu[:, 70:]
    # relative to the largest value: one bf16 ulp of a product near 8 is 0.03, above the absolute tolerance
    res[f"silu_mul_{tag}"] = [((fused_ops.silu_mul(gu).float() - want.float()).abs().max()
                               / want.float().abs().max().clamp(min=1.0)).item(), 0.0]

for arch in ("llama", "qwen3", "qwen2"):
    d = make_tiny_model(tempfile.mkdtemp(), arch)
    resolved = resolve_model(d, "auto")
    def run(model):
        kv = PagedKV(model, num_blocks=32, block_size=4, seed=1)
        a = kv.step([("a", list(range(3, 14))), ("b", [5, 6, 7])])
        b = kv.step([("a", [20]), ("b", [8, 9, 10, 11])])
        return torch.cat([a["a"], a["b"], b["a"], b["b"]])
    model = load_model(resolved, "auto", torch.float32, torch.device("cpu"), 0, None)
    plain = run(model)
    assert model.enable_fused_kernels()
    fused = run(model)
    res[f"model_{arch}"] = [(plain - fused).abs().max().item(), 0.0]
    # the Triton backend: the fused path writes the KV rows in its rotary kernel and the backend only attends
    from tallyserve.attention.backend import get_attn_backend
    for layer in model.model.layers:
        layer.self_attn.attn_backend = get_attn_backend("triton")
    calls = []
    orig = fused_ops.rotary_write_kv_
    fused_ops.rotary_write_kv_ = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    fused_triton = run(model)
    fused_ops.rotary_write_kv_ = orig
    res[f"model_{arch}_triton"] = [(plain - fused_triton).abs().max().item(), float(len(calls))]
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
    return run_interpreted(["-c", WORKER])


TOL = {"float32": 1e-5, "bfloat16": 1.6e-2}


@pytest.mark.parametrize("kernel", ["add_rms", "rms", "rotary", "qk_norm_rotary", "silu_mul", "rotary_write_kv",
                                    "rotary_write_kv_norm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_matches_torch_reference(results, kernel, dtype):
    err, side = results[f"{kernel}_{dtype}"]
    scale = 4.0 if kernel in ("add_rms", "rms", "qk_norm_rotary") else 1.0  # normalised values reach a few units
    assert err <= TOL[dtype] * scale, (kernel, dtype, err)
    if kernel == "add_rms":
        assert side <= TOL[dtype] * scale  # the residual stream was updated in place to x + residual
    if kernel in ("rotary", "qk_norm_rotary"):
        assert side == 0.0  # neighbours of the strided view were not touched
    if kernel.startswith("rotary_write_kv"):
        assert err == 0.0 and side == 0.0  # same bits as rotary + the backend's KV write, in q/k/v and the cache


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fused_model_path_matches_plain_path(results, arch):
    assert results[f"model_{arch}"][0] < 1e-4
    err, fused_writes = results[f"model_{arch}_triton"]
    assert err < 1e-4
    assert fused_writes == 2 * 2  # every layer (2) of both steps wrote its KV rows in the rotary kernel
