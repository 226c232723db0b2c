"""The compiled CPU fused operators (kernels/csrc/fused_ops_cpu.cpp) behind kernels/fused_ops.py on the CPU:
each against its PyTorch reference expression, the KV-cache write, the OpenMP worker release, and whole tiny
models through the fused path against the plain one (and against transformers, greedy)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

from tallyserve.attention import cpu_sdpa
from tallyserve.kernels import cpu_kernels
from tallyserve.attention.cpu_sdpa import CpuSdpaBackend
from tallyserve.attention.torch_ref import write_kv_cache
from tallyserve.models import cpu_layers
from tallyserve.kernels import fused_ops
from tallyserve.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from tallyserve.models.loader import load_model, resolve_model
from tests.kernel_errors import RAW_THROW
from tests.tiny_models import PagedKV, load_hf_model, make_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load() or fused_ops._INTERPRET,
                                reason="no C++ compiler for the CPU kernels (or Triton's interpreter is on)")
REPO = Path(__file__).resolve().parents[2]


def _rope(tokens: int, dim: int):
    pos = torch.arange(tokens, dtype=torch.float32) * 7 + 3
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)
    return emb.cos(), emb.sin()


def _norm(n: int, eps: float, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(n, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
    return norm


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_add_rms_norm_updates_the_residual_and_normalises_it(tokens):
    g = torch.Generator().manual_seed(tokens)
    x, r = torch.randn(tokens, 576, generator=g), torch.randn(tokens, 576, generator=g)
    norm = _norm(576, 1e-5, g)
    res = r.clone()
    got = fused_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(res, r + x)  # the residual stream, exactly as the reference adds it
    torch.testing.assert_close(got, norm(r + x), rtol=2e-6, atol=2e-6)
    plain = fused_ops.add_rms_norm(x, None, norm.weight, 1e-5)
    torch.testing.assert_close(plain, norm(x), rtol=2e-6, atol=2e-6)


def test_rotary_in_place_on_a_strided_view_equals_the_reference_bitwise():
    g = torch.Generator().manual_seed(1)
    qk = torch.randn(5, 6, 64, generator=g)
    cos, sin = _rope(5, 64)
    wide = torch.full((5, 9, 64), 7.0)  # q and k inside a wider qkv row
    wide[:, 1:7] = qk
    fused_ops.rotary_(wide[:, 1:7], cos, sin)
    assert torch.equal(wide[:, 1:7], apply_rotary(qk, cos, sin))
    assert torch.all(wide[:, [0, 7, 8]] == 7.0)  # neighbours untouched


def test_rotary_table_rows_equal_the_direct_computation_bitwise():
    """Rows gathered from the position table are exactly the per-step cos/sin (same operations), come
    as views with the table's row stride, and a table that grows keeps the outgrown one alive (a
    captured CUDA graph may still read it)."""
    rope = RotaryEmbedding(16, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    positions = torch.tensor([0, 5, 63, 64, 200, 7, 7])
    direct = rope(positions)
    cos, sin = rope(positions, max_position=200)
    assert cos.shape == sin.shape == (7, 16) and cos.stride() == sin.stride() == (32, 1)
    assert torch.equal(cos, direct[0]) and torch.equal(sin, direct[1])
    first = rope.table(torch.device("cpu"), 1)
    assert first.shape == (201, 32)
    cos2, _ = rope(torch.tensor([1000, 3]), max_position=1000)
    grown = rope.table(torch.device("cpu"), 1)
    assert grown.shape == (1001, 32) and any(t is first for t in rope._outgrown)
    assert torch.equal(cos2, rope(torch.tensor([1000, 3]))[0])
    x = torch.randn(7, 3, 16)
    y = x.clone()
    fused_ops.rotary_(y, cos, sin)
    assert torch.equal(y, apply_rotary(x, *direct))


def test_qk_norm_rotary_normalises_q_and_k_heads_with_their_own_weights():
    g = torch.Generator().manual_seed(2)
    qk = torch.randn(4, 6, 32, generator=g)
    qn, kn = _norm(32, 1e-6, g), _norm(32, 1e-6, g)
    cos, sin = _rope(4, 32)
    want = torch.cat([apply_rotary(qn(qk[:, :4]), cos, sin), apply_rotary(kn(qk[:, 4:]), cos, sin)], dim=1)
    got = qk.clone()
    fused_ops.qk_norm_rotary_(got, qn.weight, kn.weight, 4, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_silu_mul():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 2 * 1536, generator=g) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 89.0])  # past the exp's clamp on both sides
    torch.testing.assert_close(fused_ops.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=2e-6, atol=2e-6)


def test_bad_shapes_are_refused():
    """By the Python checks before the operators (ValueError; an error from a compiled kernel is unsafe on some
    hosts, see cpu_kernels)."""
    with pytest.raises(ValueError, match="residual"):
        fused_ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        fused_ops.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.add_rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="cos"):
        fused_ops.rotary_(torch.randn(2, 3, 8), *_rope(3, 8))
    with pytest.raises(ValueError, match="even D"):
        fused_ops.rotary_(torch.randn(3, 2, 7), *_rope(3, 8))
    with pytest.raises(ValueError, match="num_q_heads"):
        fused_ops.qk_norm_rotary_(torch.randn(3, 4, 8), torch.ones(8), torch.ones(8), 4, 1e-6, *_rope(3, 8))
    with pytest.raises(ValueError, match="gate_up"):
        fused_ops.silu_mul(torch.randn(2, 7).to(torch.bfloat16))


@RAW_THROW
def test_bad_shapes_are_refused_by_the_operators_too():
    ops = torch.ops.tallyserve_cpu
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="cos"):
        ops.rotary_(torch.randn(2, 3, 8), *_rope(3, 8))


def test_kv_cache_write_skips_padding_and_stores_non_finite_values_as_zero():
    g = torch.Generator().manual_seed(4)
    cache = torch.full((2, 4, 4, 3, 8), 5.0)
    want = cache.clone()
    k, v = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    k[1, 2, 3] = float("nan")
    v[2, 0, 0] = float("inf")
    slots = torch.tensor([9, 0, -1, 15])
    assert torch.ops.tallyserve_cpu.write_kv_cache_(k, v, cache, slots) == 1  # the inf sits in a padding row
    write_kv_cache(torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0),
                   torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), want, slots)
    assert torch.equal(cache, want)
    assert cache.view(2, 16, 3, 8)[0, 0, 2, 3] == 0.0 and torch.all(cache.view(2, 16, 3, 8)[:, 1:9] == 5.0)
    # a slot past the cache: refused by the backend's check before the kernel, nothing written
    before = cache.clone()
    with pytest.raises(ValueError, match="past the cache"):
        cpu_sdpa._write_kv(torch.zeros(4, 3, 8), k, v, cache, torch.tensor([16, 0, 1, 2]))
    assert torch.equal(cache, before)


@RAW_THROW
def test_kv_cache_write_refuses_a_slot_past_the_cache():
    cache = torch.zeros(2, 4, 4, 3, 8)
    k = v = torch.randn(4, 3, 8)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.tallyserve_cpu.write_kv_cache_(k, v, cache, torch.tensor([16, 0, 1, 2]))


def test_fused_ops_are_off_for_other_dtypes_and_when_disabled(monkeypatch):
    cpu = torch.device("cpu")
    assert fused_ops.available(cpu, torch.float32)
    assert not fused_ops.available(cpu, torch.bfloat16)
    monkeypatch.setenv("TALLYSERVE_FUSED_KERNELS", "0")
    assert not fused_ops.available(cpu, torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_path_matches_plain_path_and_transformers(tmp_path, arch):
    model_dir = make_tiny_model(str(tmp_path), arch)
    model = load_model(resolve_model(model_dir, "auto"), "auto", torch.float32, torch.device("cpu"), 0,
                       CpuSdpaBackend())

    def run():
        kv = PagedKV(model, num_blocks=48, block_size=4, seed=1)
        a = kv.step([("a", list(range(3, 14))), ("b", [5, 6, 7])])  # fresh prompts
        b = kv.step([("a", [20]), ("b", [8, 9, 10, 11])], num_padding=2)  # decode + a chunk over a prefix
        c = kv.step([("a", [21]), ("b", [12])])  # decode only
        return torch.cat([a["a"], a["b"], b["a"], b["b"], c["a"], c["b"]])

    plain = run()
    assert model.enable_fused_kernels() and model.model.fused
    fused = run()
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([list(range(3, 14)) + [20, 21]])).logits[0]
    assert torch.equal(fused[[10, 14, 19]].argmax(-1), ref[[10, 11, 12]].argmax(-1))
    torch.testing.assert_close(fused[[10, 14, 19]], ref[[10, 11, 12]], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("matmul_dtype", [None, torch.bfloat16])
def test_long_chunks_go_through_the_mlp_in_pieces_with_the_same_result(tmp_path, monkeypatch, matmul_dtype):
    """GatedMLP on the CPU splits a chunk longer than CPU_MLP_CHUNK_ROWS (float32) or CPU_MLP_CHUNK_ROWS_BF16 (the
    bf16 projections) into pieces of rows: same logits as the whole chunk, and the pieces of its own size ran."""
    import tallyserve.models.layers as layers

    model_dir = make_tiny_model(str(tmp_path), "llama")
    model = load_model(resolve_model(model_dir, "auto"), "auto", torch.float32, torch.device("cpu"), 0,
                       CpuSdpaBackend())
    assert model.enable_fused_kernels()
    if matmul_dtype is not None:
        model.set_matmul_dtype(matmul_dtype)
    prompt = [(7 * i) % 250 + 3 for i in range(37)]

    def run():
        kv = PagedKV(model, num_blocks=48, block_size=4, seed=1)
        return kv.step([("a", prompt), ("b", prompt[:9])])

    whole = run()
    calls = []
    silu_mul = fused_ops.silu_mul
    monkeypatch.setattr(layers, "CPU_MLP_CHUNK_ROWS", 8 if matmul_dtype is None else 1000)
    monkeypatch.setattr(layers, "CPU_MLP_CHUNK_ROWS_BF16", 1000 if matmul_dtype is None else 8)  # the other is unused
    monkeypatch.setattr(fused_ops, "silu_mul", lambda x: calls.append(x.shape[0]) or silu_mul(x))
    pieces = run()
    assert calls and max(calls) == 8 and sum(calls) == 2 * (37 + 9)  # 2 layers, 46 rows each, in pieces of 8
    torch.testing.assert_close(pieces["a"], whole["a"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieces["b"], whole["b"], rtol=1e-5, atol=1e-5)


_POOL_PROBE = r'''
import os, threading, time, torch
from tallyserve.runner.cpu_threads import release_openmp_workers
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
torch.randn(256, 256) @ torch.randn(256, 256)  # this thread's worker pool now exists
with_pool = count()
ok = release_openmp_workers()
deadline = time.monotonic() + 5.0  # the worker exits on its own schedule (a loaded machine took a while)
while count() >= with_pool and time.monotonic() < deadline:
    time.sleep(0.01)
released = count()
res = {}
t = threading.Thread(target=lambda: res.update(mm=(torch.ones(256, 256) @ torch.ones(256, 256))[0, 0].item()))
t.start(); t.join()
print("POOL", with_pool, released, ok, res["mm"])
'''


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_release_openmp_workers_frees_the_calling_threads_pool():
    """The server builds the engine on one thread and steps it on another: the builder's OpenMP workers
    must go, or every worker sleeps between operators instead of spinning (the loop thread ran 1.6x slower)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _POOL_PROBE], env=env, capture_output=True, text=True, timeout=120)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("POOL"))
    _, with_pool, released, ok, mm = line.split()
    assert ok == "True"
    assert int(released) == int(with_pool) - 1  # the one worker thread of a 2-thread pool exited
    assert float(mm) == 256.0  # a later parallel region on another thread still computes


def test_async_engine_start_releases_the_builders_pool(monkeypatch):
    from tallyserve.engine import async_engine, core_client, core_loop

    calls = []
    monkeypatch.setattr(core_client, "release_openmp_workers", lambda: calls.append(threading.get_ident()))
    monkeypatch.setattr(core_loop.EngineLoop, "run", lambda self: "stopped")

    from unittest import mock

    idle = mock.MagicMock(tokenizer=None)
    idle.stats.return_value = {}
    idle.model_config.vocab_size, idle.config.args.max_logprobs = 256, 20
    idle.config.scheduler_config.max_model_len, idle.config.scheduler_config.max_num_seqs = 64, 4
    eng = async_engine.AsyncLLMEngine(idle)
    eng.start()
    deadline = time.monotonic() + 5
    while eng.core.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [threading.get_ident()]  # on the thread that built the engine, before the loop runs


@pytest.mark.parametrize("rows,n", [(1, 576), (5, 64), (33, 1000)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_bf16_rounds_once_and_updates_the_float32_residual(rows, n, x_dtype):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(x_dtype)
    res = torch.randn(rows, n, generator=g)
    norm = _norm(n, 1e-5, g)
    want_res = x.float() + res
    want = (norm.weight * (want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-5))).to(torch.bfloat16)
    got = fused_ops.add_rms_norm(x, res, norm.weight, 1e-5, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(res, want_res)  # the residual stream stays float32, updated in place
    # one rounding of the float32 result: equal, or one bf16 ulp where the float32 sums differ in the last bit
    assert (got.float() - want.float()).abs().le(want.float().abs() * 2 ** -7 + 1e-30).all()
    assert (got != want).float().mean() < 0.01
    no_res = fused_ops.add_rms_norm(x, None, norm.weight, 1e-5, out_dtype=torch.bfloat16)
    xf = x.float()
    ref = (norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))).to(torch.bfloat16)
    assert (no_res != ref).float().mean() < 0.01


@pytest.mark.parametrize("rows,n", [(1, 1536), (7, 40), (64, 17)])
def test_silu_mul_bf16_matches_float32_math_rounded_once(rows, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(torch.bfloat16)
    gate_up[0, 0], gate_up[0, n] = -100.0, 2.0  # exp overflow side: silu(-100) is about -0
    gf = gate_up.float()
    want = (F.silu(gf[:, :n]) * gf[:, n:]).to(torch.bfloat16)
    got = fused_ops.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-30).all()  # at most one bf16 ulp (exp within 2 float ulp)
    assert (got != want).float().mean() < 0.01
    assert got[0, 0].abs() < 1e-30
    nan = gate_up.clone()
    nan[0, 1] = float("nan")
    assert torch.isnan(fused_ops.silu_mul(nan)[0, 1])


@pytest.mark.skipif(not hasattr(torch.ops.tallyserve_cpu, "gemv_bf16") if cpu_kernels.load() else True,
                    reason="the kernels were built without AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(576, 576), (7, 1536), (33, 40)])
def test_gemv_bf16_equals_float32_sums_of_bf16_products_rounded_once(rows, n, k):
    from tallyserve.models.layers import linear

    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    got = torch.ops.tallyserve_cpu.gemv_bf16(x.to(torch.bfloat16), w)
    exact = (x.to(torch.bfloat16).double() @ w.double().T)
    want = exact.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums in another order than the float64 reference: within one bf16 ulp, nearly always equal
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    assert (got != want).float().mean() < 0.02
    # linear() takes this kernel for up to four rows, then adds the float32 bias to the float32 result
    out = linear(x, w, bias)
    assert out.dtype == torch.float32 and torch.equal(out, got.float() + bias)
    with pytest.raises(ValueError, match="does not match the weight"):  # the Python check before the kernel
        linear(x[:, :-1], w, bias)


@RAW_THROW
@pytest.mark.skipif(not hasattr(torch.ops.tallyserve_cpu, "gemv_bf16") if cpu_kernels.load() else True,
                    reason="the kernels were built without AVX512-BF16")
def test_gemv_bf16_refuses_more_than_four_rows():
    """The kernel's own check; layers.linear sends it one to four rows only."""
    w = torch.randn(8, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        torch.ops.tallyserve_cpu.gemv_bf16(torch.zeros(5, 16, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_rounds_like_torch_and_zeroes_non_finite_values(dim, dtype):
    """Rows of 64 and of 40 values (a partial vector at the end) into a float32 or bfloat16 cache: the stored
    bits equal torch's conversion (round to nearest even; ties, subnormals, the largest finite values), and
    NaN / +-inf become 0 and are counted, padding rows (slot -1) included in neither."""
    g = torch.Generator().manual_seed(dim)
    cache = torch.full((2, 8, 4, 2, dim), 7.0, dtype=dtype)
    k = torch.randn(6, 2, dim, generator=g) * 3
    v = torch.randn(6, 2, dim, generator=g) * 3
    specials = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 1e-40, -3e-39,
                             3.3895e38, torch.finfo(torch.float32).max, 0.0, -0.0])
    k[0, 0, : specials.numel()] = specials
    v[3, 1, -specials.numel():] = specials
    k[1, 1, dim - 1], v[2, 0, 0], v[4, 1, 17] = float("nan"), float("inf"), float("-inf")
    k[5, 0, 3] = float("nan")  # in a padding row: neither written nor counted
    slots = torch.tensor([3, 30, 12, 0, 21, -1])
    assert torch.ops.tallyserve_cpu.write_kv_cache_(k, v, cache, slots) == 3
    want = torch.full_like(cache, 7.0)
    write_kv_cache(torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0),
                   torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), want, slots)
    assert torch.equal(cache.view(torch.int16) if dtype == torch.bfloat16 else cache.view(torch.int32),
                       want.view(torch.int16) if dtype == torch.bfloat16 else want.view(torch.int32))


@pytest.mark.parametrize("arch,matmul_dtype", [("llama", None), ("llama", torch.bfloat16), ("llama", "onednn"),
                                                ("llama", "sgemm"), ("qwen3", None), ("qwen2", None)])
def test_compiled_cpu_layers_equal_the_python_layers_bitwise(tmp_path, monkeypatch, arch, matmul_dtype):
    """A step whose requests all take the compiled attention kernel in place runs its decoder layers in one
    compiled call (tallyserve_cpu::decode_layers, float32 projections on ATen's matmul, on oneDNN's blocked
    weights ("onednn") or on the AVX2 kernel's panels ("sgemm"), or bfloat16 projections): the same operators in the same
    order as the Python layers, so the outputs and the KV cache are
    bit-identical; models it does not cover (q/k norm, biases), long chunks and TALLYSERVE_CPU_DECODE_LAYERS=0
    keep the Python layers."""
    model_dir = make_tiny_model(str(tmp_path), arch, num_key_value_heads=2)
    model = load_model(resolve_model(model_dir, "auto"), "auto", torch.float32, torch.device("cpu"), 0,
                       CpuSdpaBackend())
    assert model.enable_fused_kernels()
    kernel = matmul_dtype if matmul_dtype in ("onednn", "sgemm") else None
    packed = kernel is not None
    if matmul_dtype == "sgemm" and not torch.ops.tallyserve_cpu.sgemm_built():
        pytest.skip("the kernels were built without AVX2 + FMA")
    if packed:  # a float32 model on oneDNN's blocked weights or the AVX2 kernel's panels, as where it is faster
        assert model.pack_cpu_weights(kernel=matmul_dtype) == 4 * 2 + 1  # q/k/v, o, gate/up, down of two layers, lm_head
        matmul_dtype = None
    elif matmul_dtype is not None:
        if not hasattr(torch.ops.tallyserve_cpu, "gemv_bf16"):
            pytest.skip("the kernels were built without AVX512-BF16")
        model.set_matmul_dtype(matmul_dtype)
    inner = model.model
    used = []
    real = cpu_layers.decode_layers

    def spy(*args):
        out = real(*args)
        used.append(out is not None)
        return out

    monkeypatch.setattr(cpu_layers, "decode_layers", spy)

    def run(flag):
        monkeypatch.setenv("TALLYSERVE_CPU_DECODE_LAYERS", flag)
        used.clear()
        kv = PagedKV(model, num_blocks=64, block_size=4, seed=2, dtype=matmul_dtype or torch.float32)
        outs = [kv.step([("a", list(range(3, 14))), ("b", [5, 6, 7])]),  # short prompts: the kernel in place
                kv.step([("a", [20]), ("b", [8])], num_padding=2),  # decode with padding rows
                kv.step([("c", list(range(30, 60)))]),  # a 30-row prompt: the fused causal path, Python layers
                kv.step([("a", [21]), ("b", [9]), ("c", [61])]),  # decode of three requests
                kv.step([("d", [40, 41]), ("e", [42]), ("f", [43, 44, 45])]),  # six rows of short prompts
                kv.step([("a", [22]), ("b", [10]), ("c", [62]), ("d", [46]), ("e", [47]), ("f", [48])])]  # six rows
        logits = torch.cat([o[r] for o in outs for r in sorted(o)])
        return logits, [c.clone() for c in kv.kv_caches], list(used)

    plain, plain_caches, plain_used = run("0")
    fast, fast_caches, fast_used = run("1")
    assert not any(plain_used)
    if arch == "llama":  # the compiled call took the blocked weights wherever the model packed them
        assert (cpu_layers.layer_weights(inner)[2] is not None) == (matmul_dtype is not None or packed)
        if kernel == "sgemm":  # the panels (num_panels, K, 16), not the plain weights
            assert cpu_layers.layer_weights(inner)[2][1][0].dim() == 3
    # bfloat16: one to four rows through gemv_bf16, more through oneDNN on the blocked weights, as layers.linear
    assert fast_used == ([True, True, False, True, True, True] if arch == "llama" else [False] * 6)
    assert torch.equal(fast, plain)
    for a, b in zip(fast_caches, plain_caches):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       levels=st.integers(1, 6), specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "-0"]), max_size=4))
def test_greedy_argmax_equals_torch(rows, width, seed, levels, specials):
    """The CPU's greedy pick (argmax_rows): the index torch.argmax gives on every row, ties to the lowest index
    (few distinct values make many ties), a NaN above everything, infinities, rows shorter and longer than a
    vector, rows of one value."""
    from tallyserve.runner.sampler import greedy_token_ids

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, width), generator=g).float() - levels / 2
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-0": -0.0}
    for k, name in enumerate(specials):
        x.view(-1)[int(torch.randint(0, rows * width, (1,), generator=g))] = value[name]
    assert torch.equal(greedy_token_ids(x), x.argmax(dim=-1))
    assert torch.equal(greedy_token_ids(x), x.max(dim=-1).indices)


def test_greedy_argmax_vocabulary_rows():
    """Rows of a real vocabulary's width (49,152 logits, 64 rows over the threads), the maximum placed twice."""
    from tallyserve.runner.sampler import greedy_token_ids

    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    x[3, 40000] = x[3, 7] = 50.0  # a tie: the lower index
    x[5, 49151] = 60.0  # the last position
    got = greedy_token_ids(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got[3] == 7 and got[5] == 49151
    # what the kernel refuses (not contiguous, not 2-D) takes PyTorch's max instead
    assert torch.equal(greedy_token_ids(x[:5, :300].t()), x[:5, :300].t().argmax(dim=-1))
    assert greedy_token_ids(x[0]) == x[0].argmax()


@RAW_THROW
def test_argmax_rows_refuses_a_non_contiguous_tensor():
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="argmax_rows"):
        torch.ops.tallyserve_cpu.argmax_rows(x.t())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), n=st.integers(1, 200), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_float32_linear_on_blocked_weights_equals_aten(rows, n, k, seed):
    """layers.linear on a float32 weight packed for oneDNN (pack_cpu_weight) multiplies at every row count, one
    included, and equals ATen's product to float32 rounding (only the order of the sums differs)."""
    from tallyserve.models import cpu_products, layers

    g = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    want = F.linear(x, weight)
    assert cpu_products.pack_cpu_weight(weight)
    got = layers.linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
