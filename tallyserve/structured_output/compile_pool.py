"""The grammar-compile pool: worker processes that can be killed, a bounded queue, deadlines.

One pool per process, shared by every engine in it (their tokenizers are told to the workers by
key), started on the first compile. Each of its `max_workers` slots is a daemon thread that takes
the oldest queued job, hands it to its worker process (`compile_worker`) and waits for the answer,
for at most the job's deadline. A compile that passes it, or that every waiter gave up on
(`cancel`), ends with its worker killed; the slot starts a new worker for its next job. So a
constraint that would compile for minutes costs one slot `timeout` seconds, no thread is left
behind to keep a shutting-down process alive, and a killed compile's memory goes back at once.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from tallyserve.structured_output.compile_worker import read_frame, write_frame

logger = logging.getLogger(__name__)

DEFAULT_MAX_WORKERS = 2
DEFAULT_MAX_QUEUED = 64
_POLL_S = 0.05  # how often a waiting slot looks at its job's deadline and cancellation
_START_TIMEOUT_S = 120.0  # for a worker to import xgrammar (seconds on a loaded 2-core machine)


class CompileTimeoutError(ValueError):
    """A compile passed its deadline (--structured-outputs-compile-timeout)."""


class CompileCancelledError(Exception):
    """Nobody waits for the compile any more (its clients left, its engine shut down)."""


class CompileQueueFullError(RuntimeError):
    """Too many compiles are waiting for a worker: retry later (the server answers 429)."""


class CompileJob:
    """One constraint to compile; `future` gets the worker's answer (see `CompilePool.submit`)."""

    _ids = itertools.count()

    def __init__(self, info_key: str, info_json: Callable[[], str], kind: str, spec: str, compact: bool,
                 timeout: float, decode: Callable[[str], Any]) -> None:
        self.id = next(self._ids)
        self.info_key, self.info_json = info_key, info_json
        self.kind, self.spec, self.compact = kind, spec, compact
        self.timeout = timeout
        self.decode = decode  # the worker's serialized grammar -> a compiled grammar of this process
        self.future: Future = Future()
        self.cancelled = False
        self.seconds = 0.0  # the compile's own time, once it ran
        self.result_bytes = 0  # the size of the serialized grammar the worker sent


class _Slot:
    """One worker process and the daemon thread that feeds it jobs. The worker is started ahead
    of need: when the slot is made and again right after a kill, so a job rarely waits for Python
    and xgrammar to import (seconds on a loaded 2-core machine)."""

    def __init__(self, pool: "CompilePool", index: int) -> None:
        self.pool = pool
        self.proc: Optional[subprocess.Popen] = None
        self.ready = False  # the worker said it is ready
        self.infos: set[str] = set()
        self.job: Optional[CompileJob] = None
        self.thread = threading.Thread(target=self._run, name=f"grammar-compile-{index}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self._spawn()
            job = self.pool._next_job(self)
            if job is None:
                self.kill()
                return
            try:
                self._compile(job)
            except Exception as exc:  # noqa: BLE001 - a broken worker fails its job, never the slot
                self.kill()
                _finish(job, exc=ValueError(f"the grammar compiler failed: {type(exc).__name__}: {exc}"))
            finally:
                with self.pool._cond:
                    self.job = None

    def _spawn(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.kill()
        if self.pool.closed:
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "tallyserve.structured_output.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pool._spawned += 1

    def _worker(self, job: CompileJob) -> Optional[subprocess.Popen]:
        """This slot's worker, ready and told the job's tokenizer; None if the job was cancelled
        while the worker started (the worker goes on starting, for the next job)."""
        self._spawn()
        if not self.ready:
            if not self._wait(job, self.proc, time.monotonic() + _START_TIMEOUT_S, kill=False):
                return None
            if read_frame(self.proc.stdout) != ("ready",):
                raise RuntimeError("the compile worker process did not start")
            self.ready = True
        if job.info_key not in self.infos:
            write_frame(self.proc.stdin, ("info", job.info_key, job.info_json()))
            self.infos.add(job.info_key)
        return self.proc

    def _wait(self, job: CompileJob, proc: subprocess.Popen, deadline: float, kill: bool = True) -> bool:
        """Wait until the worker has something to say: True; False (the job ended, and with
        `kill` the worker killed) if the job is cancelled or passes `deadline` first."""
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], _POLL_S)
            if ready:
                return True
            if job.cancelled or self.pool.closed:
                if kill or self.pool.closed:
                    self.kill()
                _finish(job, exc=CompileCancelledError("the compile was cancelled"))
                return False
            if time.monotonic() > deadline:
                self.kill()
                self.pool.timeouts += 1
                _finish(job, exc=CompileTimeoutError(
                    f"did not compile within {job.timeout:g} s (--structured-outputs-compile-timeout); "
                    "simplify the constraint"))
                return False

    def _compile(self, job: CompileJob) -> None:
        proc = self._worker(job)
        if proc is None:
            return
        write_frame(proc.stdin, ("compile", job.id, job.info_key, job.kind, job.spec, job.compact))
        t0 = time.monotonic()
        if not self._wait(job, proc, t0 + job.timeout):
            return
        reply = read_frame(proc.stdout)
        job.seconds = time.monotonic() - t0
        if reply is None:  # the worker died (its memory limit, a signal)
            self.kill()
            _finish(job, exc=ValueError("the grammar compiler process died compiling it (too large?)"))
        elif reply[0] == "ok":
            job.result_bytes = len(reply[2])
            _finish(job, result=job.decode(reply[2]))
        else:
            _finish(job, exc=ValueError(reply[3] or reply[2]))

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        self.infos, self.ready = set(), False
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - a broken pipe is what we are closing anyway
                pass
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            logger.warning("grammar compile worker %d did not exit after SIGKILL", proc.pid)


def _finish(job: CompileJob, result: Any = None, exc: Optional[BaseException] = None) -> None:
    if job.future.done():
        return
    if job.cancelled and exc is None:  # the answer came after everybody stopped waiting
        exc = CompileCancelledError("the compile was cancelled")
    try:
        if exc is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(exc)
    except Exception:  # noqa: BLE001 - set by a racing cancel: the first answer stands
        pass


class CompilePool:
    """Worker processes compiling grammars; see the module docstring. Thread-safe."""

    def __init__(self, max_workers: int = DEFAULT_MAX_WORKERS, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.max_workers = max_workers
        self.max_queued = max_queued
        self._cond = threading.Condition()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._slots: list[_Slot] = []
        self.closed = False
        self.timeouts = 0
        self._spawned = 0  # worker processes started (tests read it)

    def submit(self, job: CompileJob) -> Future:
        """Queue `job`; its future gets the compiled grammar or the compile's error.
        CompileQueueFullError when `max_queued` jobs already wait."""
        with self._cond:
            if self.closed:
                raise CompileCancelledError("the grammar compile pool is shut down")
            if len(self._queue) >= self.max_queued:
                raise CompileQueueFullError(f"{len(self._queue)} grammar compiles are already waiting")
            self._queue.append(job)
            busy = sum(s.job is not None for s in self._slots)
            if len(self._slots) < self.max_workers and busy + len(self._queue) > len(self._slots):
                self._slots.append(_Slot(self, len(self._slots)))
            self._cond.notify()
        return job.future

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for `job`: drop it from the queue, or kill the worker compiling it."""
        with self._cond:
            job.cancelled = True
            try:
                self._queue.remove(job)
            except ValueError:
                return  # running (its slot sees the flag within _POLL_S) or done
        _finish(job, exc=CompileCancelledError("the compile was cancelled"))

    def prestart(self) -> None:
        """Start a worker now (at server start), so the first compile does not wait for one."""
        with self._cond:
            if not self._slots and self.max_workers > 0 and not self.closed:
                self._slots.append(_Slot(self, 0))

    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def running(self) -> int:
        with self._cond:
            return sum(s.job is not None for s in self._slots)

    def _next_job(self, slot: _Slot) -> Optional[CompileJob]:
        with self._cond:
            while not self._queue and not self.closed:
                self._cond.wait()
            if self.closed:
                return None
            slot.job = self._queue.popleft()
            return slot.job

    def close(self) -> None:
        """Fail every queued job and kill every worker (running compiles end as cancelled)."""
        with self._cond:
            self.closed = True
            queued, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for job in queued:
            _finish(job, exc=CompileCancelledError("the grammar compile pool is shut down"))
        for slot in self._slots:
            slot.kill()


_pool: Optional[CompilePool] = None
_pool_lock = threading.Lock()


def shared_pool() -> CompilePool:
    """This process's pool, made on first use; its workers are killed at exit."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.closed:
            _pool = CompilePool()
        return _pool


def pool_gauges() -> tuple[int, int]:
    """(compiles waiting for a worker, compiles running) in this process's pool."""
    pool = _pool
    return (pool.queue_depth(), pool.running()) if pool is not None else (0, 0)


@atexit.register
def _close_at_exit() -> None:
    if _pool is not None:
        _pool.close()
