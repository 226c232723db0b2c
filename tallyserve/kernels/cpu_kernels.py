"""tallyserve's compiled CPU kernels (`csrc/`), built once per machine with the local C++ compiler.

`make install` builds them (`python -m tallyserve.kernels.cpu_kernels`); otherwise the first use
builds them (about half a minute) into PyTorch's extension cache. Without a compiler, or if the build
fails, `load()` returns False once, with a logged warning, and callers keep their PyTorch paths.
`TALLYSERVE_CPU_KERNELS=0` turns them off.

Errors. A kernel refuses a bad input with TORCH_CHECK, a C++ exception that PyTorch hands to Python as a
RuntimeError. On some hosts that crossing is unsafe (issue 36: torch 2.11 + CUDA 13 on an Intel Xeon, where any
exception thrown from a `torch.utils.cpp_extension` op ends the process with a segmentation fault), so:
  * the Python callers validate the kernels' inputs before each call (block ids and seq_lens against the cache
    and the block table, slots against the cache, logits row indices, task-pool thread counts, the shapes and
    dtypes the kernels take): a bad input raises ValueError in Python and never reaches a TORCH_CHECK, which stays
    as a second line. The per-step checks are a few tensor reductions per forward pass (`check_slots`, the
    attention plan's `validate`), not per layer;
  * `load()` probes once per build, in a subprocess (`sys.executable -c ...`), that an error thrown in the
    extension (`tallyserve_cpu::probe_error`, on the calling thread and in a task on the worker threads) reaches
    Python as a RuntimeError. Where it does not (the subprocess dies by a signal or exits nonzero), it logs one
    warning and returns False: the PyTorch paths are used. The verdict is kept next to the built library
    (`<library>.errors-probe`, keyed by the library's SHA-1 and the torch version), so later processes do not
    probe again; `errors_cross()` returns it.
`TALLYSERVE_CPU_ERROR_PROBE` steers the probe: `auto` (default) as above; `fail` forces the probe's failure without
running it (not cached; for tests of the fallback); `ignore` uses the kernels even where the probe failed (with a
warning), trusting the Python checks to keep bad inputs out: e.g. to run the kernel tests on such a host, where
the tests that need the raw C++ throw skip (`errors_cross()` is False).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from tallyserve import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "attention_d64_cpu.cpp", _CSRC / "attention_amx_cpu.cpp",
            _CSRC / "fused_ops_cpu.cpp", _CSRC / "decode_layers_cpu.cpp", _CSRC / "sampling_ops_cpu.cpp",
            _CSRC / "sgemm_avx2_cpu.cpp", _CSRC / "task_pool_cpu.cpp"]
_HEADERS = [_CSRC / "simd_cpu.h", _CSRC / "cpu_math.h", _CSRC / "attention_vec_cpu.h", _CSRC / "attention_d64_cpu.h",
            _CSRC / "attention_amx_cpu.h", _CSRC / "fused_ops_cpu.h", _CSRC / "task_pool_cpu.h"]
_NAME = "tallyserve_cpu_kernels"
_lock = threading.Lock()
_state: dict = {}  # "ok": load()'s answer; "library": the built library's path; "errors_cross": the probe's verdict

PROBE_ENV = "TALLYSERVE_CPU_ERROR_PROBE"
_PROBE_MESSAGE = "the error the load-time probe expects"
# The probe: load the library in a fresh interpreter and catch probe_error's RuntimeError, thrown on the calling
# thread (0) and in a parallel task (1), with the task pool off and on; exit 0 only if all four were caught.
# probe_error is a CPU-key kernel taking a tensor, as every kernel is: on the GPU host of issue 37 an error from an
# operator without a dispatch key reached Python while one from a CPU-key kernel ended the process.
_PROBE_SCRIPT = f"""
import sys
import torch

torch.ops.load_library(sys.argv[1])
ops = torch.ops.tallyserve_cpu
caught = 0
for threads in (0, 2):
    ops.set_task_pool_threads(threads)
    for where in (0, 1):
        try:
            ops.probe_error(torch.zeros(1), where)
        except RuntimeError as exc:
            caught += {_PROBE_MESSAGE!r} in str(exc)
ops.set_task_pool_threads(0)
sys.exit(0 if caught == 4 else 3)
"""
_PROBE_TIMEOUT_S = 300


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the kernels; True when `torch.ops.tallyserve_cpu` is usable: built, and an
    error from it reaches Python as an exception (the probe; see the module's docstring)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if not envs.TALLYSERVE_CPU_KERNELS:
            _state["ok"] = False
            return False
        try:
            from torch.utils import cpp_extension

            headers = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(_HEADERS))).hexdigest()[:12]
            library = cpp_extension.load(name=_NAME, sources=[str(s) for s in _SOURCES], is_python_module=False,
                                         # the headers' hash in the flags: a header change alone rebuilds too
                                         extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                                                       "-fno-trapping-math", f"-DTALLYSERVE_HEADERS={headers}"],
                                         extra_ldflags=["-fopenmp"],
                                         verbose=verbose)
            built = hasattr(torch.ops.tallyserve_cpu, "paged_attention")
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the PyTorch paths stay
            logger.warning("tallyserve CPU kernels unavailable (%s: %s); using the PyTorch attention path",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            _state["ok"] = False
            return False
        if not built:
            _state["ok"] = False
            return False
        _state["library"] = library = _library_path(library)
        mode = envs.TALLYSERVE_CPU_ERROR_PROBE
        cross, why = _probe(library, force_fail=mode == "fail")
        _state["errors_cross"] = cross
        if cross:
            _state["ok"] = True
        elif mode == "ignore":
            logger.warning("tallyserve CPU kernels: an error raised in them does not reach Python here (%s); used "
                           "anyway (%s=ignore), only the Python input checks stand between a bad input and a crash",
                           why, PROBE_ENV)
            _state["ok"] = True
        else:
            logger.warning("tallyserve CPU kernels: an error raised in them does not reach Python here (%s); using "
                           "the PyTorch paths", why)
            _state["ok"] = False
        return _state["ok"]


def errors_cross() -> Optional[bool]:
    """Whether an error thrown in the built kernels reaches Python as an exception (the load-time probe's verdict;
    False when forced by TALLYSERVE_CPU_ERROR_PROBE=fail); None when the kernels did not build or are off."""
    load()
    return _state.get("errors_cross")


def _library_path(returned) -> Optional[str]:
    """The built library: what cpp_extension.load returned (its path, in the PyTorch versions that return it), else
    the one of this name among the libraries torch.ops loaded."""
    if isinstance(returned, str) and os.path.isfile(returned):
        return returned
    for path in sorted(getattr(torch.ops, "loaded_libraries", ())):
        if os.path.basename(path).startswith(_NAME):
            return path
    return None


def _probe(library: Optional[str], force_fail: bool = False) -> tuple[bool, str]:
    """(errors cross, why not): the verdict cached next to the library for this build, else the probe subprocess'
    (then cached, when it gave one: exited, or died by a signal)."""
    if force_fail:
        return False, f"forced by {PROBE_ENV}=fail"
    if not library:
        return False, "the built library was not found, so the probe could not run"
    try:
        key = f"{hashlib.sha1(Path(library).read_bytes()).hexdigest()} torch-{torch.__version__}"
    except OSError as exc:
        return False, f"the built library could not be read for the probe: {exc}"
    verdict_file = Path(library + ".errors-probe")
    try:
        cached = verdict_file.read_text().split("\n")[0].rsplit(" ", 1)
        if len(cached) == 2 and cached[0] == key and cached[1] in ("ok", "fail"):
            return cached[1] == "ok", "the probe of this build, cached in " + str(verdict_file)
    except OSError:
        pass
    if not sys.executable:
        return False, "no Python executable to run the probe with"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, library], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"the probe subprocess did not finish in {_PROBE_TIMEOUT_S} s"
    except OSError as exc:
        return False, f"the probe subprocess could not start: {exc}"
    if done.returncode == 0:
        cross, why = True, ""
    elif done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        cross, why = False, f"the probe subprocess died by {name}"
    else:
        tail = done.stderr.decode(errors="replace").strip().splitlines()
        cross, why = False, (f"the probe subprocess exited with status {done.returncode}"
                             + (f": {tail[-1]}" if tail else ""))
    tmp = verdict_file.with_name(f"{verdict_file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{key} {'ok' if cross else 'fail'}\n{why}\n")
        os.replace(tmp, verdict_file)
    except OSError as exc:  # a read-only cache: probe again next time
        logger.debug("could not keep the CPU kernels' probe verdict in %s: %s", verdict_file, exc)
    return cross, why


_pool_max: list[int] = []


def set_task_pool_threads(n: int) -> None:
    """``tallyserve_cpu::set_task_pool_threads`` with its argument checked first: ValueError outside 0 (off) to the
    pool's maximum (the kernels must be loaded)."""
    if not _pool_max:
        _pool_max.append(int(torch.ops.tallyserve_cpu.task_pool_max_threads()))
    try:
        count = operator.index(n)
    except TypeError:
        count = -1
    if not 0 <= count <= _pool_max[0]:
        raise ValueError(f"set_task_pool_threads: 0 (off) to {_pool_max[0]} threads, got {n!r}")
    torch.ops.tallyserve_cpu.set_task_pool_threads(count)


def int_bounds(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer CPU tensor, for the input checks: up to 64 values through a Python list
    (the first ATen reduction of a decode step, its code out of cache after the layers, took 10-20 us; the list
    2-5), more with one aminmax (3 us when warm; a list of 256 took 12)."""
    if t.numel() <= 64:
        values = t.reshape(-1).tolist()
        return min(values), max(values)
    lo, hi = t.aminmax()
    return int(lo), int(hi)


# (slot_mapping, rows, slots) of the last check_slots that passed: the layers of one pass share one slot_mapping
_slots_checked: list = [(None, -1, -1)]


def check_slots(slot_mapping: torch.Tensor, rows: int, kv_cache: torch.Tensor) -> None:
    """ValueError unless the first ``rows`` slots of ``slot_mapping`` (negative: padding, not written) lie inside
    ``kv_cache`` (2, num_blocks, block_size, ...), as ``write_kv_cache_`` requires. One max per pass: a check of the
    same tensor (the same object: a pass's slot_mapping is not changed in place) against as many slots passes at
    once."""
    slots = kv_cache.shape[1] * kv_cache.shape[2]
    last = _slots_checked[0]
    if last[0] is slot_mapping and last[1] == rows and last[2] == slots:
        return
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < rows:
        raise ValueError(f"slot_mapping must be 1-D with at least {rows} entries; got {tuple(slot_mapping.shape)}")
    if rows:
        top = int_bounds(slot_mapping[:rows])[1]
        if top >= slots:
            raise ValueError(f"slot {top} is past the cache's {slots} slots")
    _slots_checked[0] = (slot_mapping, rows, slots)


if __name__ == "__main__":
    ok = load(verbose=False)
    if ok and errors_cross() is False:  # TALLYSERVE_CPU_ERROR_PROBE=ignore
        print("tallyserve CPU kernels: built, in use although an error thrown in them does not reach Python here")
    elif errors_cross() is False:
        print("tallyserve CPU kernels: built, but an error thrown in them does not reach Python here (PyTorch paths "
              "are used)")
    else:
        print("tallyserve CPU kernels:", "built" if ok else "unavailable (PyTorch paths are used)")
