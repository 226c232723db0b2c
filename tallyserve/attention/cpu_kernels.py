"""tallyserve's compiled CPU kernels (`csrc/`), built once per machine with the local C++ compiler.

`make install` builds them (`python -m tallyserve.attention.cpu_kernels`); otherwise the first use
builds them (about half a minute) into PyTorch's extension cache. Without a compiler, or if the build
fails, `load()` returns False once, with a logged warning, and callers keep their PyTorch paths.
`TALLYSERVE_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp",
            Path(__file__).parent / "csrc" / "fused_ops_cpu.cpp",
            Path(__file__).parent / "csrc" / "decode_layers_cpu.cpp",
            Path(__file__).parent / "csrc" / "attention_amx_cpu.cpp",
            Path(__file__).parent / "csrc" / "sampling_ops_cpu.cpp",
            Path(__file__).parent / "csrc" / "sgemm_avx2_cpu.cpp",
            Path(__file__).parent / "csrc" / "task_pool_cpu.cpp"]
_HEADERS = [Path(__file__).parent / "csrc" / "cpu_math.h", Path(__file__).parent / "csrc" / "fused_ops_cpu.h",
            Path(__file__).parent / "csrc" / "attention_amx_cpu.h", Path(__file__).parent / "csrc" / "amx_tiles.h",
            Path(__file__).parent / "csrc" / "attention_vec_cpu.h",
            Path(__file__).parent / "csrc" / "attention_avx2_cpu.h",
            Path(__file__).parent / "csrc" / "attention_avx512_cpu.h",
            Path(__file__).parent / "csrc" / "task_pool_cpu.h"]
_NAME = "tallyserve_cpu_kernels"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the kernels; True when `torch.ops.tallyserve_cpu` is usable."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if os.environ.get("TALLYSERVE_CPU_KERNELS", "1") == "0":
            _state["ok"] = False
            return False
        try:
            from torch.utils import cpp_extension

            headers = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(_HEADERS))).hexdigest()[:12]
            cpp_extension.load(name=_NAME, sources=[str(s) for s in _SOURCES], is_python_module=False,
                               # the headers' hash in the flags: a header change alone rebuilds too
                               extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                                             f"-DTALLYSERVE_HEADERS={headers}"],
                               extra_ldflags=["-fopenmp"],
                               verbose=verbose)
            _state["ok"] = hasattr(torch.ops.tallyserve_cpu, "paged_attention")
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the PyTorch paths stay
            logger.warning("tallyserve CPU kernels unavailable (%s: %s); using the PyTorch attention path",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            _state["ok"] = False
        return _state["ok"]


if __name__ == "__main__":
    ok = load(verbose=False)
    print("tallyserve CPU kernels:", "built" if ok else "unavailable (PyTorch paths are used)")
