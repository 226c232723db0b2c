"""Every environment variable tallyserve reads, typed and documented once (vLLM's envs.py pattern).

Read ``envs.TALLYSERVE_X``: each access reads the environment again, so a test may set a variable with
``monkeypatch.setenv`` and the next call sees it. Nothing else in tallyserve reads ``TALLYSERVE_*`` from
``os.environ`` (tests/unit/test_envs.py checks this, and that docs/configuration.md lists every one). The
compiled CPU kernels read ``TALLYSERVE_CPU_AMX`` themselves (csrc/attention_amx_cpu.cpp); it is listed here
so that it is documented in the same place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


def _flag(name: str, default: bool = True) -> Callable[[], bool]:
    """``0`` turns a default-on switch off (and ``1`` a default-off one on)."""
    return lambda: os.environ.get(name, "1" if default else "0").strip() != "0"


def _choice(name: str, default: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, default).strip().lower() or default


def _text(name: str) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or None


@dataclass(frozen=True)
class EnvVar:
    read: Callable[[], Any]
    default: str
    doc: str


environment_variables: dict[str, EnvVar] = {
    # ----------------------------------------------------------------- general
    "TALLYSERVE_DEVICE": EnvVar(
        _text("TALLYSERVE_DEVICE"), "unset", "the device `device=\"auto\"` picks (`cpu`, `cuda`, `cuda:N`)"),
    "TALLYSERVE_CACHE_DIR": EnvVar(
        _text("TALLYSERVE_CACHE_DIR"), "`~/.cache/tallyserve`",
        "where converted GGUF weights (and dummy presets' files) are cached"),
    "TALLYSERVE_WORKER_LOG_LEVEL": EnvVar(
        lambda: os.environ.get("TALLYSERVE_WORKER_LOG_LEVEL", "WARNING"), "`WARNING`",
        "log level of tensor-parallel worker processes"),
    "TALLYSERVE_FUSED_KERNELS": EnvVar(
        _flag("TALLYSERVE_FUSED_KERNELS"), "`1`",
        "`0` turns the fused per-layer operators off (CPU and CUDA) and the Triton bitmask kernel: every "
        "layer runs the PyTorch reference expressions"),
    "TALLYSERVE_COMPILE_WORKER_MEMORY": EnvVar(
        _text("TALLYSERVE_COMPILE_WORKER_MEMORY"), "1 GiB",
        "bytes a grammar-compile worker process may allocate beyond what it uses at start (RLIMIT_DATA); a "
        "compile past it fails as a 400"),
    # ----------------------------------------------------------------- CPU
    "TALLYSERVE_CPU_THREADS": EnvVar(
        _choice("TALLYSERVE_CPU_THREADS", "auto"), "`auto`",
        "`auto`: use the cores other processes leave free, or share every core with them at four times the "
        "start count where that gives more; a number pins it"),
    "TALLYSERVE_CPU_KERNELS": EnvVar(
        _flag("TALLYSERVE_CPU_KERNELS"), "`1`", "`0` turns the compiled CPU kernels off (PyTorch paths only)"),
    "TALLYSERVE_CPU_ERROR_PROBE": EnvVar(
        _choice("TALLYSERVE_CPU_ERROR_PROBE", "auto"), "`auto`",
        "`auto`: once per build, a subprocess checks that an error thrown in the compiled CPU kernels reaches "
        "Python as an exception (on some hosts it ends the process instead); where it does not, a warning and "
        "the PyTorch paths. `fail` forces that fallback (tests); `ignore` uses the kernels anyway, relying on "
        "the Python input checks"),
    "TALLYSERVE_CPU_SGEMM": EnvVar(
        _choice("TALLYSERVE_CPU_SGEMM", "auto"), "`auto`",
        "float32 projections on tallyserve's AVX2 kernel (`1`) or a library (`0`, then "
        "`TALLYSERVE_CPU_ONEDNN_FP32` picks); `auto`: the kernel on CPUs whose best vector unit is AVX2 (no "
        "AVX-512), 1.1-1.35x faster than oneDNN there"),
    "TALLYSERVE_CPU_ONEDNN_FP32": EnvVar(
        _choice("TALLYSERVE_CPU_ONEDNN_FP32", "auto"), "`auto`",
        "float32 projections on oneDNN's blocked weights (`1`) or ATen's matmul (`0`); `auto` times both once "
        "at start and takes oneDNN when it is 10% faster"),
    "TALLYSERVE_CPU_DECODE_LAYERS": EnvVar(
        _flag("TALLYSERVE_CPU_DECODE_LAYERS"), "`1`",
        "`0` keeps a step's decoder layers in Python (one compiled call otherwise)"),
    "TALLYSERVE_CPU_AMX": EnvVar(
        _flag("TALLYSERVE_CPU_AMX"), "`1`",
        "`0` keeps prompt attention over a bfloat16 cache off the AMX tiles (float32 vector path); read by "
        "the compiled kernel"),
    # ----------------------------------------------------------------- GPU
    "TALLYSERVE_TRITON_GEMV": EnvVar(
        _flag("TALLYSERVE_TRITON_GEMV"), "`1`", "`0`: one-row projections on cuBLAS instead of the Triton GEMV"),
    "TALLYSERVE_PDL": EnvVar(
        _flag("TALLYSERVE_PDL"), "`1`",
        "`0`: no programmatic dependent launch of the Triton kernels (for drivers or tools that mishandle it)"),
    "TALLYSERVE_GEMV_TILES": EnvVar(
        lambda: os.environ.get("TALLYSERVE_GEMV_TILES", "").strip(), "unset",
        "`\"NxK=BLOCK_N,BLOCK_K,WARPS;...\"` forces the GEMV tiles of given shapes (tuning a new GPU)"),
}


def __getattr__(name: str) -> Any:
    var = environment_variables.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return list(environment_variables)
