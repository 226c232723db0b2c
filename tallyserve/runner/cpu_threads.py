"""How many threads the CPU forward pass uses, following the cores other processes leave free.

PyTorch's intra-op threads meet at a barrier after every operator. When another process takes a core,
one of them is descheduled for whole scheduler slices while the other waits at the barrier, and a
forward pass of many small operators slows down several-fold (a 2-core machine with one busy loop beside
it ran a workload 3-7x slower with 2 threads, where 1 thread would have been about 1.8x). So every
half second or more the governor reads how much CPU time the machine spent outside this process
(``/proc/stat`` against this process's own CPU time) and either uses the cores left over,
``clamp(floor(cores - others + 0.3), 1, max_threads)``, or, where that leaves too little, shares every core with the
neighbours at four times the start count (``threads_for``): the count changes only after two windows agree (or one
window of ``LONG_WINDOW_S``, as a long prompt step makes). While sharing, steps of fewer than ``SHARED_MIN_TOKENS``
tokens (decode) still run on the free cores: their operators are too short to share. On a
2-core AMD EPYC (Zen 4), W in bfloat16 took 18.0 s quiet; beside a busy loop 33.7 s on one thread (the old rule),
44.1 s on two spinning threads and 28.0 s on four sharing threads (1.55x quiet).

Where the forward's heavy operators are tallyserve's compiled kernels (float32 on the AVX2 product,
``cpu_task_pool``), sharing runs them on the kernels' task pool instead (``task_pool_cpu.h``), ATen on one thread:
a pool call ends when its tasks are done, not when every thread has come through, so a descheduled thread costs
the task it holds, not a scheduler slice per operator, and decode steps share too. Beside a busy loop on a 2-core
Zen 3, W's 64-row decode steps took 338 ms on the pool (2 to 4 threads) against 375 ms on one free core and 546 ms
on two OpenMP threads (quiet: 189 ms).

``TALLYSERVE_CPU_THREADS``: ``auto`` (the default) adapts as above; a number pins it.

OpenMP keeps one worker pool per thread that has run a parallel region, and GNU OpenMP counts the workers of
every pool: once they outnumber the cores, all workers stop spin-waiting between regions and sleep on a futex
instead, and each small operator pays a wake-up. A server builds the engine on its main thread (loading
weights runs parallel regions there) and steps it on the engine-loop thread, so two pools existed and decode
matmuls of one row ran 3-7x slower than on the thread that built them (a single stream decoded at 55 ms per
token against 35 ms offline). ``release_openmp_workers()`` frees the calling thread's pool
(``omp_pause_resource_all``); the async engine calls it on the building thread when the loop thread starts.

``keep_freed_memory()``: glibc's malloc hands every allocation above a dynamic threshold (128 KiB at first)
back to the kernel when it is freed, so each large activation of a prefill step (8192 rows x 960 values in
float32: 31 MB) was mapped again and paid a page fault per 4 KiB on first touch. The CPU engine raises the
threshold to glibc's maximum (32 MiB) and the trim threshold to 1 GiB, so freed activations are reused:
workload W's prompts took 5.2 -> 4.4 s with bfloat16 projections (the ``MALLOC_*_`` variables, if set, win).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time
from typing import Callable, Optional

import torch

from tallyserve import envs
from tallyserve.kernels import cpu_kernels

logger = logging.getLogger(__name__)

WINDOW_S = 0.5
# A window this long averages enough on its own: a prompt step of 8,192 tokens takes seconds on two cores, and
# waiting for a second window kept W's first prompt steps on too few threads beside a busy neighbour.
LONG_WINDOW_S = 2.0
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_machine_busy_seconds() -> Optional[float]:
    """CPU seconds all cores spent busy since boot (``/proc/stat``), or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [int(x) for x in fields[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    guest = sum(vals[8:10]) if len(vals) > 9 else 0  # already counted in user / nice
    return (sum(vals) - idle - guest) / _HZ  # steal counts as busy: a core the hypervisor gave away


_OMP_PAUSE_SOFT = 1
_omp_lib: list = []  # [ctypes library or None], looked up once


def _openmp_runtime() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime PyTorch loaded (GNU or Intel), or None."""
    if not _omp_lib:
        lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
            for path in sorted(paths):
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp5", "libomp")):
                    cand = ctypes.CDLL(path)
                    if hasattr(cand, "omp_pause_resource_all"):
                        lib = cand
                        break
        except OSError:
            lib = None
        _omp_lib.append(lib)
    return _omp_lib[0]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30
_malloc_tuned: list[bool] = []


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks up to 32 MiB for reuse (see the module docstring); once per
    process. False where malloc is not glibc's, or the user set ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` (theirs stand)."""
    if _malloc_tuned:
        return _malloc_tuned[0]
    ok = False
    if not any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        try:
            libc = ctypes.CDLL(None)
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None and hasattr(libc, "gnu_get_libc_version"):
                ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
                    bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        except OSError:
            ok = False
    _malloc_tuned.append(ok)
    return ok


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool (a later parallel region on this thread makes a new one).

    Call it on a thread that is done with compute before another thread takes over the forward passes;
    True when the runtime released it."""
    lib = _openmp_runtime()
    if lib is None:
        return False
    try:
        return lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (AttributeError, OSError):
        return False


# Sharing the cores: threads per thread at start, and the work a shared thread does against a quiet one (W with 4
# threads on 2 quiet cores took 1.08x its 2-thread time; the spare 2% covers the scheduler's switches). Four per
# thread: the kernel's fair scheduler gives 8 threads 8/9 of 2 cores beside one busy loop, and the products and
# attention items are taken from a shared counter, so a descheduled thread holds up one task, not a fixed share.
# Beside a busy loop on a 2-core Zen 3, W's prompts took 36.1 / 32.1 s on 8 threads against 48.3 / 36.5 s on 4
# (quiet: 28.9 / 24.3 s).
SHARE_THREADS_FACTOR = 4
SHARED_EFFICIENCY = 0.9
# While sharing, a neighbour's measured share shrinks with our thread count (one busy loop beside 8 threads: about
# 2/9 of 2 cores), so sharing stops only when the others' load falls below this (they left).
SHARED_STAY_OTHERS = 0.1


# Steps of fewer tokens than this run on the free cores even while the governor shares them all: a decode step's
# operators last tens of microseconds, and every descheduled sharing thread holds its team at the barrier for a
# scheduler slice. Beside a busy loop on 2 cores, W's 64-row decode steps took 10.1 s on one thread and 12.3 s on
# four; its prompt steps (8,192 tokens) 22.6 s on one and 19.0-19.5 s on three to eight.
SHARED_MIN_TOKENS = 256


def free_threads(cores: int, others: float, max_threads: int) -> int:
    """The cores other processes leave free: ``floor(cores - others + 0.3)``, between 1 and ``max_threads``."""
    return max(1, min(max_threads, math.floor(cores - others + 0.3)))


def threads_for(cores: int, others: float, max_threads: int) -> int:
    """Threads to use when other processes take ``others`` cores' worth of CPU on a ``cores``-core machine.

    Two ways to run beside them: on the cores they leave free (``floor(cores - others + 0.3)``, at most
    ``max_threads``), or sharing every core with them: ``SHARE_THREADS_FACTOR * max_threads`` threads, which the
    kernel's fair scheduler gives ``n / (n + k)`` of the cores against ``k`` busy threads of theirs (GNU OpenMP stops
    spin-waiting once its threads outnumber the cores, so a descheduled worker holds nobody at a barrier).
    Sharing is taken when its estimate (times ``SHARED_EFFICIENCY``) beats the free cores by a quarter core or a tenth
    of the cores, whichever is more: one busy loop on a 2-core machine leaves one free core, and sharing with 8
    threads gives about 1.6. With many cores and few neighbours (16 cores, 3 busy) the free cores win and nothing is
    oversubscribed."""
    free = free_threads(cores, others, max_threads)
    if free >= max_threads or others < 0.3:
        return free
    n = SHARE_THREADS_FACTOR * max_threads
    their_threads = max(1, math.ceil(others - 0.3))
    shared = min(n, cores * n / (n + their_threads)) * SHARED_EFFICIENCY
    return n if shared > free + max(0.25, 0.1 * cores) else free


def cpu_task_pool(model) -> Optional[Callable[[int], None]]:
    """The compiled kernels' task-pool setter (``cpu_kernels.set_task_pool_threads``: a count outside the pool's range
    is a ValueError, never the kernel's own check) where ``model``'s
    projections run on tallyserve's AVX2 product (``pack_cpu_weights(kernel="sgemm")``), so the forward's heavy
    operators (products, attention, norms) are the kernels' own; None otherwise."""
    if getattr(model, "cpu_products", None) != "sgemm":
        return None

    return cpu_kernels.set_task_pool_threads if cpu_kernels.load() else None


class CpuThreadGovernor:
    def __init__(self, max_threads: Optional[int] = None,
                 busy_seconds: Callable[[], Optional[float]] = read_machine_busy_seconds,
                 own_seconds: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 task_pool: Optional[Callable[[int], None]] = None) -> None:
        """``task_pool``: sets the compiled kernels' task pool to n threads (0: off), given when the forward's heavy
        operators run on them (``cpu_task_pool``); while sharing the cores, the forward then runs on the pool and
        ATen on one thread, at every step size."""
        setting = envs.TALLYSERVE_CPU_THREADS
        self._start_threads = torch.get_num_threads()  # restored by close(): the count is process-wide
        self.max_threads = max_threads or torch.get_num_threads()
        self.enabled = setting == "auto"
        if not self.enabled:
            try:
                pinned = int(setting)
            except ValueError:
                raise ValueError(f"TALLYSERVE_CPU_THREADS must be 'auto' or a number of threads, got {setting!r}")
            if pinned < 1:
                raise ValueError(f"TALLYSERVE_CPU_THREADS must be at least 1, got {pinned}")
            set_threads(pinned)
            self.max_threads = pinned
        self._busy, self._own, self._clock, self._set_aten = busy_seconds, own_seconds, clock, set_threads
        self._pool = task_pool if self.enabled else None
        try:
            self.cores = len(os.sched_getaffinity(0))
        except AttributeError:
            self.cores = os.cpu_count() or 1
        self.threads = self.max_threads  # in use now
        self.decision = self.free = self.max_threads  # threads_for's answer, and the free cores, at the last change
        self._mark = self._sample()
        self._pending: Optional[int] = None
        self.changes = 0

    def _sample(self) -> Optional[tuple[float, float, float]]:
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def step(self, num_tokens: Optional[int] = None) -> int:
        """Call once per forward pass with the step's scheduled tokens; returns the thread count it runs on.

        While the cores are shared (``decision`` above the start count), a step of fewer than
        ``SHARED_MIN_TOKENS`` tokens runs on the free cores instead; ``None`` counts as a large step."""
        if not self.enabled or self._mark is None or self.max_threads <= 1:
            return self.threads
        self._decide()
        want = self.decision
        if want > self.max_threads and self._pool is None and num_tokens is not None and \
                num_tokens < SHARED_MIN_TOKENS:
            want = self.free
        if want != self.threads:
            self._set(want)
            self.threads = want
        return self.threads

    def _decide(self) -> None:
        now = self._clock()
        if now - self._mark[0] < WINDOW_S:
            return
        cur = self._sample()
        if cur is None:
            return
        wall = cur[0] - self._mark[0]
        others = max(0.0, (cur[1] - self._mark[1]) - (cur[2] - self._mark[2])) / wall
        self._mark = cur
        want = threads_for(self.cores, others, self.max_threads)
        if self.decision > self.max_threads and others >= SHARED_STAY_OTHERS:
            want = self.decision  # still sharing with them (see SHARED_STAY_OTHERS)
        if want == self.decision:
            self._pending = None
        elif self._pending == want or wall >= LONG_WINDOW_S:  # two windows in a row agree, or one long one
            logger.info("CPU threads %d -> %d (other processes use %.2f of %d cores)", self.decision, want, others,
                        self.cores)
            self.decision, self.free, self._pending = want, free_threads(self.cores, others, self.max_threads), None
            self.changes += 1
        else:
            self._pending = want

    def _set(self, n: int) -> None:
        """Run the forward on n threads: ATen's, or above the start count with a task pool, the pool's (ATen on one)."""
        if self._pool is None:
            self._set_aten(n)
        elif n > self.max_threads:
            self._set_aten(1)
            self._pool(n)
        else:
            self._pool(0)
            self._set_aten(n)

    def close(self) -> None:
        """Give the process back the thread count it had before this governor (an engine shutting down)."""
        if self.threads != self._start_threads:
            self._set(self._start_threads)
            self.threads = self._start_threads
        if self._pool is not None:
            self._pool(0)
