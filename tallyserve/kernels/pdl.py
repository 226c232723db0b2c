"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it on the stream still
runs, once every program of that kernel has signalled (``launch_dependents``) or exited. It must call
``wait`` before it reads anything an earlier kernel wrote: ``wait`` returns when the earlier kernel
has finished and its writes are visible. The projections of a batch-1 step (``gemv``) use this to
start streaming their weights while the small kernel before them still runs. The other kernels of a
decode step (add + RMSNorm, rotary, the KV write, decode attention and its reduce) are dependent
launches too: they signal and then wait as their first statement (``enter``), so each one is already
resident when the one before it ends, and the launch gaps of a step's ~340 kernels overlap. Both
calls are compiled only where ``pdl_enabled`` (a constexpr ``PDL`` flag), so the kernels run
unchanged elsewhere (older GPUs, the interpreter). ``TALLYSERVE_PDL=0`` turns it off.
"""

from __future__ import annotations

import os

import torch

from tallyserve import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

try:
    from triton.language.extra import cuda as _tl_cuda
except ImportError:  # pragma: no cover - no triton, or one without the CUDA extras
    _tl_cuda = None

# Triton's interpreter (TRITON_INTERPRET=1, read when kernels are decorated): CPU tensors run the Triton kernels
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
# grid dependency control in this Triton (not in the interpreter)
_GDC = (triton is not None and _tl_cuda is not None and not INTERPRET and hasattr(_tl_cuda, "gdc_wait")
        and hasattr(_tl_cuda, "gdc_launch_dependents"))
_by_device: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` use programmatic dependent launch: NVIDIA compute capability 9.0 or
    later, a Triton with grid dependency control, and TALLYSERVE_PDL not 0."""
    if not _GDC or device.type != "cuda" or not envs.TALLYSERVE_PDL:
        return False
    if torch.version.hip is not None:  # ROCm reports its own capability numbers and has no griddepcontrol
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _by_device:
        _by_device[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _by_device[index]


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a launch of a kernel with a ``PDL`` constexpr: the flag, and ``launch_pdl``
    where ``pdl_enabled`` (one lookup per launch)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """First statement of a kernel launched with ``launch_pdl``: let the next kernel launch, then
        wait for the one before (nothing is read before this returns)."""
        if PDL:
            _tl_cuda.gdc_launch_dependents()
            _tl_cuda.gdc_wait()

    @triton.jit
    def launch_dependents(PDL: tl.constexpr):
        """Let the next kernel (if launched with ``launch_pdl``) start now."""
        if PDL:
            _tl_cuda.gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Wait for the kernel before this one to finish (its writes visible)."""
        if PDL:
            _tl_cuda.gdc_wait()
