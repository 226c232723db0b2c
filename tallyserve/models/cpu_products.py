"""Which kernel multiplies a CPU model's projections, and the weight copies each one needs (``layers.linear``
multiplies whatever a weight carries): oneDNN's blocked copy (``pack_cpu_weight``), tallyserve's AVX2 panels
(``pack_sgemm_weight``), or the plain bfloat16 weight through ``gemv_bf16`` for one to four rows; and the
once-per-process verdicts on whether a float32 model packs for either (``sgemm_float32_pays``,
``onednn_float32_pays``)."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from tallyserve import envs
from tallyserve.kernels import cpu_kernels

logger = logging.getLogger(__name__)

# bfloat16 products of up to this many rows run gemv_bf16 on the plain weight; more rows, oneDNN's blocked copy
CPU_GEMV_MAX_ROWS = 4


def pack_cpu_weight(weight: torch.Tensor, rows_hint: int = 64) -> bool:
    """Attach oneDNN's blocked copy of a bfloat16 or float32 CPU weight (``weight.mkldnn_packed``), which
    ``linear`` then multiplies: bfloat16 from five rows on (the plain weight stays for one to four rows,
    ``gemv_bf16``), float32 at every row count (``onednn_float32_pays`` decides whether a float32 model packs).
    The plain layout was re-blocked on every call (64 decode rows of the bundled model's bf16 MLP: 0.49 -> 0.28 ms;
    lm_head 8.3 -> 3.8 ms), with bit-identical results. False where this PyTorch build has no such operators."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        probe = torch.zeros(CPU_GEMV_MAX_ROWS + 1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    weight.mkldnn_packed = packed
    return True


def pack_sgemm_weight(weight: torch.Tensor) -> bool:
    """Attach the panels of tallyserve's AVX2 float32 kernel to a float32 CPU weight (``weight.sgemm_packed``, the
    weight's rows 16 at a time, interleaved per input feature), which ``linear`` then multiplies at every row count
    (``sgemm_float32_pays`` decides whether a float32 model packs). False where the kernels lack it."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu" or not cpu_kernels.load() or \
            not torch.ops.tallyserve_cpu.sgemm_built():
        return False
    weight.sgemm_packed = torch.ops.tallyserve_cpu.pack_sgemm_weight(weight)
    return True


_onednn_f32: list[bool] = []
_sgemm_f32: list[bool] = []


def sgemm_float32_pays() -> bool:
    """Whether a float32 model on the CPU multiplies on tallyserve's AVX2 kernel (``pack_sgemm_weight``) rather than
    on oneDNN's blocked weights or ATen's matmul: ``TALLYSERVE_CPU_SGEMM`` 1 / 0 forces it; by default it does on
    CPUs whose best vector unit is AVX2 (``torch.backends.cpu.get_cpu_capability()``), where the libraries' float32
    kernels are 8 lanes wide too: on a 2-core AMD EPYC (Zen 3) the kernel ran the bundled model's products, their
    weights coming from memory as in a step, 1.1-1.35x faster than oneDNN (prompt chunks at 92% of the FMA peak).
    With AVX-512 the libraries' 16-lane kernels are the faster ones. (A timing probe at start was tried: on a busy
    2-core machine its answer changed from one process to the next.)"""
    if _sgemm_f32:
        return _sgemm_f32[0]
    forced = envs.TALLYSERVE_CPU_SGEMM
    want = forced == "1" if forced in ("0", "1") else torch.backends.cpu.get_cpu_capability() == "AVX2"
    verdict = want and pack_sgemm_weight(torch.zeros(16, 16))
    _sgemm_f32.append(verdict)
    return verdict


def _best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def onednn_float32_pays() -> bool:
    """Whether a float32 model on the CPU multiplies on oneDNN's blocked weights (``pack_cpu_weight``) rather than
    ATen's matmul: ``TALLYSERVE_CPU_ONEDNN_FP32`` 1 / 0 forces it; by default a probe, once per process, times both
    on 4 and 64 rows of a 1,024 x 1,024 weight and packs when oneDNN is at least 10% faster on both. Which library
    is faster depends on the CPU: on a 2-core AMD EPYC (Zen 4) oneDNN ran the bundled model's products 1.2-4x
    faster at 1-256 rows (lm_head, 64 rows: 37 -> 20 ms), where ATen's matmul took its slower code path."""
    if _onednn_f32:
        return _onednn_f32[0]
    forced = envs.TALLYSERVE_CPU_ONEDNN_FP32
    if forced in ("0", "1"):
        verdict = forced == "1"
    else:
        verdict = _probe_onednn_float32()
    _onednn_f32.append(verdict)
    return verdict


def _probe_onednn_float32(size: int = 1024, repeats: int = 5) -> bool:
    weight = torch.randn(size, size)
    if not pack_cpu_weight(weight):
        return False
    packed = weight.mkldnn_packed
    faster = []
    for rows in (4, 64):
        x = torch.randn(rows, size)
        aten = _best_time(lambda: F.linear(x, weight), repeats)
        onednn = _best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)
        faster.append(onednn * 1.1 <= aten)
        logger.debug("float32 product probe, %d rows: ATen %.3f ms, oneDNN %.3f ms", rows, aten * 1e3, onednn * 1e3)
    return all(faster)


_gemv_ok: list[bool] = []


def cpu_gemv_serves(weight: torch.Tensor) -> bool:
    """Whether ``tallyserve_cpu::gemv_bf16`` serves this weight (a contiguous CPU tensor; the kernels built
    with AVX512-BF16)."""
    if weight.device.type != "cpu" or not weight.is_contiguous():
        return False
    if not _gemv_ok:
        _gemv_ok.append(bool(cpu_kernels.load() and hasattr(torch.ops.tallyserve_cpu, "gemv_bf16")))
    return _gemv_ok[0]
