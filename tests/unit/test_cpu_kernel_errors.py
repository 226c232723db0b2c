"""Errors of the compiled CPU kernels (issue 36: on some hosts an exception thrown in a torch.utils.cpp_extension op
ends the process with a segmentation fault). Bad inputs on the kernels' paths (block ids, slots, row indices, thread
counts, the decoder layers' one call) are ValueErrors raised in Python before any kernel call, in this process and in
a subprocess that must live on (exit 0); the load-time probe's verdict (subprocess, cached next to the library) and,
when it fails (forced with TALLYSERVE_CPU_ERROR_PROBE=fail, or a probe that crashes), the fallback to the PyTorch
paths with one warning and correct results."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tallyserve.attention import cpu_sdpa
from tallyserve.kernels import cpu_kernels
from tallyserve.attention.cpu_sdpa import CpuSdpaBackend
from tallyserve.models import cpu_layers, cpu_products
from tallyserve.kernels import fused_ops
from tallyserve.runner import cpu_threads
from tallyserve.runner.sampler import greedy_token_ids
from tallyserve.kernels import logits_mask as bitmask_kernel
from tests.unit.test_attention_ref import dense_causal_attention, make_case

KERNEL = cpu_kernels.load()
REPO = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(not KERNEL, reason="the CPU kernels are not in use here (no compiler, turned off, "
                                                      "or the load-time probe failed)")
built = pytest.mark.skipif(cpu_kernels.errors_cross() is None, reason="the CPU kernels did not build (or are off)")
REQS = [(5, 1), (0, 3), (9, 2), (14, 1)]  # decode rows and short chunks: the kernel reads them in place


def _case(seed: int = 1):
    q, k, v, cache, meta, full_k, full_v = make_case(REQS, 4, 2, 64, 4, seed=seed, num_padding=1)
    cache.copy_(cache.nan_to_num(0.0))
    return q, k, v, cache, meta, full_k, full_v


def _check_against_reference(out, q, meta, full_k, full_v, scale):
    for i, (_, new) in enumerate(REQS):
        lo = meta.query_start_loc_cpu[i]
        ref = dense_causal_attention(q[lo:lo + new], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[lo:lo + new], ref, atol=1e-5, rtol=0)


@needs_kernels
def test_bad_block_ids_and_slots_are_value_errors_before_the_kernel():
    q, k, v, cache, meta, full_k, full_v = _case()
    backend = CpuSdpaBackend()
    for where, value in [((1, 0), cache.shape[1]), ((2, 2), -1), ((3, 3), 10**6)]:
        bad = meta.block_tables.clone()
        bad[where] = value
        with pytest.raises(ValueError, match="block id out of range"):
            backend.forward(q, k, v, cache.clone(), dataclasses.replace(meta, block_tables=bad), 0.125)
    # a table entry past a request's length is never read: not an error (as in the kernel)
    padded = torch.cat([meta.block_tables, torch.full((len(REQS), 2), 10**6, dtype=torch.int32)], dim=1)
    out = backend.forward(q, k, v, cache.clone(), dataclasses.replace(meta, block_tables=padded), 0.125)
    _check_against_reference(out, q, meta, full_k, full_v, 0.125)
    # a seq_len past its block table
    short = dataclasses.replace(meta, block_tables=meta.block_tables[:, :1].contiguous())
    with pytest.raises(ValueError, match="past its block table"):
        backend.forward(q, k, v, cache.clone(), short, 0.125)
    # a slot past the cache: refused before anything is written
    slots = meta.slot_mapping.clone()
    slots[2] = cache.shape[1] * cache.shape[2]
    before = cache.clone()
    with pytest.raises(ValueError, match="past the cache"):
        backend.forward(q, k, v, cache, dataclasses.replace(meta, slot_mapping=slots), 0.125)
    assert torch.equal(cache, before)
    # and the good pass afterwards is right
    _check_against_reference(backend.forward(q, k, v, cache, meta, 0.125), q, meta, full_k, full_v, 0.125)


@needs_kernels
def test_other_bad_kernel_inputs_are_value_errors():
    with pytest.raises(ValueError, match="0 \\(off\\) to"):
        cpu_kernels.set_task_pool_threads(-3)
    with pytest.raises(ValueError, match="outside the logits"):
        bitmask_kernel.mask_logits_rows_(torch.zeros(3, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3]))
    with pytest.raises(ValueError, match="residual"):
        fused_ops.add_rms_norm(torch.randn(2, 8), torch.randn(2, 9), torch.ones(8), 1e-6)


@needs_kernels
@pytest.mark.parametrize("compiled_layers", ["1", "0"])
def test_bad_block_id_on_a_model_step_is_a_value_error(tmp_path, monkeypatch, compiled_layers):
    """A model step whose block table names a block outside the cache: a ValueError on the decoder layers' one
    compiled call (cpu_layers) and on the Python layers alike; the model's next good step is unaffected."""
    from tallyserve.models.loader import load_model, resolve_model
    from tests.tiny_models import PagedKV, make_tiny_model

    monkeypatch.setenv("TALLYSERVE_CPU_DECODE_LAYERS", compiled_layers)
    model_dir = make_tiny_model(str(tmp_path), "llama", num_key_value_heads=2)
    model = load_model(resolve_model(model_dir, "auto"), "auto", torch.float32, torch.device("cpu"), 0,
                       CpuSdpaBackend())
    assert model.enable_fused_kernels()
    kv = PagedKV(model, num_blocks=16, block_size=4, seed=3)
    for c in kv.kv_caches:
        c.zero_()
    ids, positions, meta = kv.build([("a", [3, 4, 5, 6, 7]), ("b", [8])])
    bad = meta.block_tables.clone()
    bad[0, 1] = 16
    with torch.no_grad(), pytest.raises(ValueError, match="block id out of range") as err:
        model(ids, positions, kv.kv_caches, dataclasses.replace(meta, block_tables=bad))
    on_compiled = any(Path(str(entry.path)).name == "cpu_layers.py" for entry in err.traceback)
    assert on_compiled == (compiled_layers == "1")
    with torch.no_grad():
        assert not model(ids, positions, kv.kv_caches, meta).isnan().any()


_SUBPROCESS = r"""
import dataclasses, sys
import torch
from tallyserve.kernels import cpu_kernels
from tallyserve.attention.cpu_sdpa import CpuSdpaBackend
from tests.unit.test_attention_ref import make_case

print("kernels", cpu_kernels.load(), flush=True)
q, k, v, cache, meta, _, _ = make_case([(5, 1), (0, 3)], 4, 2, 64, 4, seed=1)
cache.copy_(cache.nan_to_num(0.0))
bad = meta.block_tables.clone()
bad[1, 0] = cache.shape[1]
slots = meta.slot_mapping.clone()
slots[0] = cache.shape[1] * cache.shape[2]
cases = {"block": dataclasses.replace(meta, block_tables=bad), "slot": dataclasses.replace(meta, slot_mapping=slots)}
for name, m in cases.items():
    try:
        CpuSdpaBackend().forward(q, k, v, cache, m, 0.125)
    except (ValueError, RuntimeError, IndexError) as exc:
        print("caught", name, type(exc).__name__, flush=True)
try:
    cpu_kernels.set_task_pool_threads(10**6)
except ValueError:
    print("caught threads ValueError", flush=True)
CpuSdpaBackend().forward(q, k, v, cache, meta, 0.125)
print("alive", flush=True)
"""


@pytest.mark.parametrize("mode", ["auto", "ignore"])
def test_bad_inputs_in_a_subprocess_leave_it_alive(mode):
    """The same bad block id and slot in a fresh process: caught as exceptions, the process goes on and exits 0.
    Under TALLYSERVE_CPU_ERROR_PROBE=ignore the kernels are in use even where the probe failed, so this shows the
    Python checks keep the bad inputs from them (ValueError) on such a host too."""
    if cpu_kernels.errors_cross() is None:
        pytest.skip("the CPU kernels did not build (or are turned off)")
    env = dict(os.environ, **{cpu_kernels.PROBE_ENV: mode})
    done = subprocess.run([sys.executable, "-c", _SUBPROCESS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "alive" and "caught threads ValueError" in lines
    kernels = lines[0] == "kernels True"
    assert kernels == (cpu_kernels.errors_cross() is True or mode == "ignore")
    want = "ValueError" if kernels else None  # the PyTorch paths: the index_select's own error
    for name in ("block", "slot"):
        caught = [line for line in lines if line.startswith(f"caught {name} ")]
        assert len(caught) == 1 and (want is None or caught[0].endswith(want)), lines


@pytest.fixture
def fresh_load(monkeypatch):
    """load() runs again (restored afterwards), with the caches of what it answered that other modules keep."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpu_products, "_gemv_ok", [])
    monkeypatch.setattr(cpu_products, "_sgemm_f32", [])
    monkeypatch.setattr(cpu_sdpa, "_fast_rows", [])
    monkeypatch.setattr(cpu_sdpa, "_last_plan", [None, None, None])
    monkeypatch.delenv(cpu_kernels.PROBE_ENV, raising=False)
    return monkeypatch


def _kernel_warnings(caplog):
    return [r for r in caplog.records if r.name == cpu_kernels.__name__ and r.levelno == logging.WARNING]


@built
def test_forced_probe_failure_falls_back_to_the_pytorch_paths(fresh_load, caplog, tmp_path):
    fresh_load.setenv(cpu_kernels.PROBE_ENV, "fail")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is False
        assert cpu_kernels.load() is False  # decided once
    warnings = _kernel_warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert "does not reach Python" in warnings[0].getMessage() and "PyTorch paths" in warnings[0].getMessage()
    assert cpu_kernels.errors_cross() is False

    # attention: the gather + SDPA path, never the kernel, right against the dense reference
    def no_kernel(*args, **kwargs):
        raise AssertionError("the compiled attention ran")

    fresh_load.setattr(cpu_sdpa, "paged_attention_kernel", no_kernel)
    q, k, v, cache, meta, full_k, full_v = _case(seed=5)
    _check_against_reference(CpuSdpaBackend().forward(q, k, v, cache, meta, 0.125), q, meta, full_k, full_v, 0.125)

    # fused operators, products, sampling ops and the task pool: all off
    cpu = torch.device("cpu")
    assert not fused_ops.available(cpu, torch.float32)
    assert not cpu_products.pack_sgemm_weight(torch.randn(16, 16))
    assert not cpu_products.cpu_gemv_serves(torch.randn(16, 16).to(torch.bfloat16))
    assert not bitmask_kernel.available(torch.zeros(2, 64))
    assert cpu_threads.cpu_task_pool(type("M", (), {"cpu_products": "sgemm"})()) is None
    logits = torch.randn(5, 300)
    assert torch.equal(greedy_token_ids(logits), logits.argmax(dim=-1))

    # a whole model: the plain layers (no fused kernels, no compiled decoder layers), equal to transformers
    from tallyserve.models.loader import load_model, resolve_model
    from tests.tiny_models import PagedKV, load_hf_model, make_tiny_model

    model_dir = make_tiny_model(str(tmp_path), "llama", num_key_value_heads=2)
    model = load_model(resolve_model(model_dir, "auto"), "auto", torch.float32, cpu, 0, CpuSdpaBackend())
    assert not model.enable_fused_kernels()
    assert cpu_layers.layer_weights(model.model) is None
    kv = PagedKV(model, num_blocks=48, block_size=4, seed=1)
    prompt = list(range(3, 14))
    a = kv.step([("a", prompt)])["a"]
    b = kv.step([("a", [20])])["a"]
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [20]])).logits[0]
    torch.testing.assert_close(torch.cat([a, b]), ref, rtol=1e-4, atol=1e-4)


@built
@pytest.mark.parametrize("script,why", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "died by SIGSEGV"),
    ("import os; os.abort()", "died by SIGABRT"),
    ("import sys; sys.exit(3)", "exited with status 3"),
])
def test_a_probe_that_does_not_catch_the_error_turns_the_kernels_off(fresh_load, caplog, tmp_path, script, why):
    """The probe's subprocess dying (as a process whose C++ exception crashes it) or failing: load() returns False
    with one warning saying so; the verdict is kept next to the library, so the next start does not probe again;
    TALLYSERVE_CPU_ERROR_PROBE=ignore then uses the kernels anyway."""
    library = tmp_path / "tallyserve_cpu_kernels.so"  # a copy: the shared build's verdict stays as it is
    shutil.copy(cpu_kernels._library_path(None) or pytest.skip("the built library was not found"), library)
    fresh_load.setattr(cpu_kernels, "_library_path", lambda returned: str(library))
    fresh_load.setattr(cpu_kernels, "_PROBE_SCRIPT", script)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is False
    warnings = _kernel_warnings(caplog)
    assert len(warnings) == 1 and why in warnings[0].getMessage() and "PyTorch paths" in warnings[0].getMessage()
    assert cpu_kernels.errors_cross() is False
    verdict = Path(str(library) + ".errors-probe").read_text().splitlines()
    assert verdict[0].endswith(" fail") and why in verdict[1]

    def no_subprocess(*args, **kwargs):
        raise AssertionError("probed again")

    fresh_load.setattr(cpu_kernels.subprocess, "run", no_subprocess)
    assert cpu_kernels._probe(str(library)) == (False, f"the probe of this build, cached in {library}.errors-probe")
    fresh_load.setattr(cpu_kernels, "_state", {})
    fresh_load.setenv(cpu_kernels.PROBE_ENV, "ignore")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is True and cpu_kernels.errors_cross() is False
    assert "used anyway" in _kernel_warnings(caplog)[0].getMessage()


@built
def test_the_real_probe_agrees_with_the_verdict_in_use_and_is_keyed_by_the_library(tmp_path):
    if os.environ.get(cpu_kernels.PROBE_ENV, "auto") != "auto":
        pytest.skip(f"{cpu_kernels.PROBE_ENV} is set")
    library = tmp_path / "tallyserve_cpu_kernels.so"
    shutil.copy(cpu_kernels._library_path(None), library)
    cross, why = cpu_kernels._probe(str(library))
    assert cross == cpu_kernels.errors_cross() and (cross or why)
    key, verdict = Path(str(library) + ".errors-probe").read_text().splitlines()[0].rsplit(" ", 1)
    assert verdict == ("ok" if cross else "fail") and torch.__version__ in key
    with open(library, "ab") as f:  # another build: another key, so the verdict is not reused
        f.write(b"\0")
    Path(str(library) + ".errors-probe").write_text(f"{key} {'fail' if cross else 'ok'}\n")
    assert cpu_kernels._probe(str(library))[0] == cross
