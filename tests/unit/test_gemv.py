"""The one-row projection kernel (kernels/gemv.py) on the CPU under Triton's interpreter: products
against a float64 reference (uneven K, a partial last block of outputs, the wide-output tiles), the
fused SiLU-and-multiply input against ``fused_ops.silu_mul`` then the product, and a tiny bfloat16
model whose one-row steps go through the kernel against the same model with it turned off. Runs in
one subprocess, since Triton reads TRITON_INTERPRET when a kernel is decorated. The compiled kernel,
with programmatic dependent launch, is in test_triton_compile_sm90.py and tests/gpu."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpreter_too_old, run_interpreted

triton = pytest.importorskip("triton")
if interpreter_too_old(triton):
    pytest.skip("Triton < 3.7's interpreter cannot run these loops under NumPy 2", allow_module_level=True)

SHAPES = [(37, 96), (64, 256), (16392, 64), (40, 2048)]  # (N, K)

WORKER = r'''
import json, os, tempfile
import torch
from tallyserve.kernels import fused_ops, gemv
from tallyserve.models.loader import load_model, resolve_model
from tests.tiny_models import PagedKV, make_tiny_model

res = {}
g = torch.Generator().manual_seed(0)
for n, k in SHAPES:
    for dtype in (torch.bfloat16, torch.float16) if n < 16384 else (torch.bfloat16,):  # the wide case is slow here
        tag = f"{n}x{k}_{str(dtype).split('.')[-1]}"
        w = (0.1 * torch.randn(n, k, generator=g)).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        want = x.double() @ w.double().T
        got = gemv.gemv(x, w)
        res["plain_" + tag] = [(got.double() - want).abs().max().item(), want.abs().max().item(), str(got.dtype),
                               list(got.shape)]
        got32 = gemv.gemv(x, w, out_dtype=torch.float32)
        res["f32out_" + tag] = [(got32.double() - want).abs().max().item(), want.abs().max().item(), str(got32.dtype),
                                list(got32.shape)]
        gate_up = torch.randn(1, 2 * k, generator=g).to(dtype)
        want = fused_ops.silu_mul(gate_up).double() @ w.double().T
        got = gemv.gemv(gate_up, w, silu_mul_input=True)
        res["silu_" + tag] = [(got.double() - want).abs().max().item(), want.abs().max().item(), str(got.dtype),
                              list(got.shape)]
try:
    gemv.gemv(torch.zeros(1, 95, dtype=torch.bfloat16), torch.zeros(8, 96, dtype=torch.bfloat16))
    res["bad_width"] = "no error"
except ValueError as exc:
    res["bad_width"] = str(exc)
res["usable"] = [gemv.usable(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),
                 gemv.usable(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)),
                 gemv.usable(torch.zeros(1, 8), torch.zeros(4, 8)),
                 gemv.usable(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16).T)]

calls = []
real = gemv.gemv
def counting(*a, **kw):
    calls.append(kw.get("silu_mul_input", False))
    return real(*a, **kw)
gemv.gemv = counting
d = make_tiny_model(tempfile.mkdtemp(), "llama")
model = load_model(resolve_model(d, "auto"), "auto", torch.bfloat16, torch.device("cpu"), 0, None)
assert model.enable_fused_kernels()
def run():
    kv = PagedKV(model, num_blocks=32, block_size=4, seed=1, dtype=torch.bfloat16)
    rows = [kv.step([("a", list(range(3, 14)))])["a"][-1:]]
    for tok in (20, 7, 41):
        rows.append(kv.step([("a", [tok])])["a"])
    return torch.cat(rows)
os.environ["TALLYSERVE_TRITON_GEMV"] = "0"
off = run()
res["calls_off"] = len(calls)
os.environ["TALLYSERVE_TRITON_GEMV"] = "1"
on = run()
res["calls_on"] = [len(calls), sum(calls)]
res["layers"] = model.config.num_hidden_layers
res["model"] = [(on[1:] - off[1:]).abs().max().item(), off.abs().max().item(), (on[0] - off[0]).abs().max().item(),
                on[1:].argmax(-1).tolist() == off[1:].argmax(-1).tolist()]
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def results():
    return run_interpreted(["-c", f"SHAPES = {SHAPES!r}\n" + WORKER], timeout=600)


# the exact product rounded once: within one rounding of the largest output (bf16 8 bits, fp16 11)
ULP = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


@pytest.mark.parametrize("kind", ["plain", "f32out", "silu"])
@pytest.mark.parametrize("n,k,dtype", [(n, k, dt) for n, k in SHAPES for dt in ("bfloat16", "float16")
                                       if n < 16384 or dt == "bfloat16"])  # the wide tiles: bf16 only (slow here)
def test_product_matches_float64_reference(results, kind, dtype, n, k):
    err, scale, out_dtype, shape = results[f"{kind}_{n}x{k}_{dtype}"]
    assert shape == [1, n]
    assert out_dtype == ("torch.float32" if kind == "f32out" else f"torch.{dtype}")
    bound = (2.0 ** -14 if kind == "f32out" else ULP[dtype]) * scale  # f32out: float32 sums, no rounding
    assert 0 < scale and err <= bound + 1e-6 * scale, (kind, dtype, n, k, err, scale)


def test_wrong_input_width_is_a_value_error(results):
    assert "(1, 96)" in results["bad_width"] and "(1, 95)" in results["bad_width"]


def test_kernel_serves_only_one_contiguous_half_precision_row(results):
    # one bf16 row: yes; two rows, float32, a transposed (non-contiguous) weight: no
    assert results["usable"] == [True, False, False, False]


def test_tiny_bf16_model_one_row_steps_go_through_the_kernel(results):
    layers = results["layers"]
    assert results["calls_off"] == 0
    # three one-row decode steps: q/k/v, o, gate/up and down (SiLU-fused) per layer, and the lm_head
    total, fused = results["calls_on"]
    assert (total, fused) == (3 * (4 * layers + 1), 3 * layers)
    diff, scale, prefill_diff, same_tokens = results["model"]
    assert prefill_diff == 0.0  # the 11-token prefill never uses the kernel
    assert diff <= 0.03 * scale and same_tokens, (diff, scale)



def test_dependent_launch_only_on_nvidia_gpus_and_not_when_switched_off(monkeypatch):
    from tallyserve.kernels import pdl

    monkeypatch.setattr(pdl, "_GDC", True)
    monkeypatch.setattr(pdl, "_by_device", {0: True})  # as if device 0 were a Hopper GPU
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TALLYSERVE_PDL", raising=False)
    cuda0 = torch.device("cuda", 0)
    assert pdl.pdl_enabled(cuda0) and pdl.launch_options(cuda0) == {"PDL": True, "launch_pdl": True}
    assert not pdl.pdl_enabled(torch.device("cpu")) and pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TALLYSERVE_PDL", "0")
    assert not pdl.pdl_enabled(cuda0) and pdl.launch_options(cuda0) == {"PDL": False}
    monkeypatch.delenv("TALLYSERVE_PDL")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not pdl.pdl_enabled(cuda0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "_by_device", {0: False})  # an older GPU
    assert not pdl.pdl_enabled(cuda0)


def test_forced_tiles_apply_to_their_exact_shapes_only_and_typos_are_errors(monkeypatch):
    pytest.importorskip("triton")
    from tallyserve.kernels import gemv

    monkeypatch.delenv("TALLYSERVE_GEMV_TILES", raising=False)
    default_down, default_o = gemv._config(4096, 12288), gemv._config(4096, 4096)
    monkeypatch.setenv("TALLYSERVE_GEMV_TILES", " 4096x12288=4,2048,8 ; 24576X4096=32,128,4;")
    assert gemv._config(4096, 12288) == (4, 2048, 8) and gemv._config(24576, 4096) == (32, 128, 4)
    assert gemv._config(4096, 4096) == default_o, "other shapes keep the defaults"
    monkeypatch.setenv("TALLYSERVE_GEMV_TILES", "4096x64=8,1024,4")
    assert gemv._config(4096, 64) == (8, 64, 4), "BLOCK_K never exceeds the row"
    monkeypatch.setenv("TALLYSERVE_GEMV_TILES", "4096x12288=8,1024")
    with pytest.raises(ValueError, match="TALLYSERVE_GEMV_TILES"):
        gemv._config(4096, 12288)
    monkeypatch.delenv("TALLYSERVE_GEMV_TILES")
    assert gemv._config(4096, 12288) == default_down


def test_swept_tiles_per_preset_shape():
    pytest.importorskip("triton")
    from tallyserve.kernels import gemv

    # the H200 sweeps' winners: Qwen3-8B's gate/up, Llama-3-8B's gate/up, down up to 4096 outputs, Nemo's down
    assert gemv._config(24576, 4096) == (16, 512, 4)
    assert gemv._config(28672, 4096) == (16, 256, 4)
    assert gemv._config(4096, 12288) == (8, 1024, 4) and gemv._config(4096, 14336) == (8, 1024, 4)
    assert gemv._config(5120, 14336) == (8, 512, 4)
