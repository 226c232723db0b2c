"""Grammar compilation for structured outputs (xgrammar), cached per (kind, spec, options).

Compiles run in the compile pool's worker processes (`compile_pool`), never on the step loop
and never on a thread that could not be stopped: ``submit`` returns a future the engine polls,
and a second request with the same constraint shares the first one's future (then its compiled
grammar). Each ``submit`` is one waiter and each waiter ``release``s it when it stops waiting; a
compile nobody waits for any more is cancelled (its worker killed). Before anything compiles the
constraint is checked against the limits (`limits`). A constraint that does not compile, passes
a limit or its deadline raises ``ValueError`` naming the field (structured_outputs.json, .regex,
...), never anything the server would turn into a 500.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

from tallyserve.config import json_object_arg
from tallyserve.sampling_params import StructuredOutputsParams
from tallyserve.structured_output.compile_pool import (CompileCancelledError, CompileJob, CompilePool,
                                                       CompileTimeoutError, shared_pool)
from tallyserve.structured_output.limits import StructuredOutputsLimits

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarKey(tuple):
    """(kind, canonical spec, options): what a compiled grammar is cached under."""

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> "GrammarKey":
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend: "
                             "use disable_any_whitespace for compact JSON")
        if kind == "json":
            spec = json_object_arg("structured_outputs.json", params.json, "a JSON schema object")
            text = json.dumps(spec, sort_keys=True, ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(params.choice), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(params, kind)
        return cls((kind, text, bool(params.disable_any_whitespace)))

    @property
    def kind(self) -> str:
        return self[0]


def _clean(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = _XGR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return msg[:500]


COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class CompileStats:
    """Counters the server exports (tallyserve_structured_output_*)."""

    requests: dict[str, int] = field(default_factory=dict)  # structured-output requests by kind
    compiles: int = 0
    cache_hits: int = 0
    failures: int = 0
    compile_seconds_sum: float = 0.0
    compile_bucket_counts: list[int] = field(default_factory=lambda: [0] * len(COMPILE_BUCKETS))
    timeouts: int = 0  # compiles that passed their deadline
    cancelled: int = 0  # compiles dropped because nobody waited for them any more
    rejected: int = 0  # constraints over a limit, refused before compiling

    def count_request(self, kind: str) -> None:
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def observe_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_seconds_sum += seconds
        for i, bound in enumerate(COMPILE_BUCKETS):
            if seconds <= bound:
                self.compile_bucket_counts[i] += 1
                break




@dataclass(frozen=True)
class CompileTicket:
    """One waiter's claim on a compile: the grammar's key and its (shared) future."""

    key: GrammarKey
    future: Future


@dataclass
class _Entry:
    job: Optional[CompileJob]
    future: Future
    waiters: int = 0
    nbytes: int = 0  # the compiled grammar's serialized size: the cache keeps a bounded total


class GrammarCompileCache:
    """Compiles constraints for one tokenizer; each distinct key compiles once (futures shared).
    At most `max_entries` grammars and `max_bytes` of them (by serialized size) stay cached; the
    oldest finished ones go first."""

    def __init__(self, tokenizer_info: Any, limits: Optional[StructuredOutputsLimits] = None,
                 pool: Optional[CompilePool] = None, max_entries: int = 512, max_bytes: int = 256 << 20) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._info = tokenizer_info
        self._info_json: Optional[str] = None
        self._info_key = f"{id(self):x}"
        self.limits = limits or StructuredOutputsLimits.default()
        self._pool = pool
        self._entries: dict[GrammarKey, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._closed = False
        self.stats = CompileStats()

    @property
    def pool(self) -> CompilePool:
        return self._pool if self._pool is not None else shared_pool()

    def _tokenizer_json(self) -> str:
        with self._lock:
            if self._info_json is None:
                self._info_json = self._info.serialize_json()
                self._info_key = hashlib.sha1(self._info_json.encode()).hexdigest()[:16]
            return self._info_json

    def check(self, key: GrammarKey) -> None:
        """ValueError if `key` is over a limit or uses what the backend cannot enforce."""
        try:
            self.limits.check(key.kind, key[1])
        except ValueError:
            self.stats.rejected += 1
            raise

    def submit(self, key: GrammarKey, count_hit: bool = True) -> Future:
        """The future of ``key``'s compiled grammar (shared with every earlier request for it);
        the caller is one more waiter and must `release(key)` when it stops waiting (a compile
        nobody waits for is cancelled). ``count_hit``: False for a validation compile, so the
        request's own add counts once. ValueError over a limit; CompileQueueFullError when the
        pool's queue is full."""
        self.check(key)
        info_json = self._tokenizer_json()
        with self._lock:
            if self._closed:
                raise CompileCancelledError("the engine is shutting down")
            entry = self._entries.get(key)
            if entry is not None and not _cancelled(entry.future):
                self.stats.cache_hits += count_hit
                entry.waiters += 1
                return entry.future
            job = CompileJob(self._info_key, lambda: info_json, key[0], key[1], key[2], self.limits.compile_timeout,
                             self._decode)
            entry = _Entry(job, job.future, waiters=1)
            self._entries[key] = entry
        try:
            self.pool.submit(job)
        except Exception:
            with self._lock:
                self._entries.pop(key, None)
            raise
        job.future.add_done_callback(lambda fut, key=key, entry=entry: self._done(key, entry))
        return job.future

    def release(self, key: GrammarKey) -> None:
        """One waiter of `key` stopped waiting; the last one cancels a compile still under way."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.waiters = max(0, entry.waiters - 1)
            if entry.waiters or entry.future.done() or entry.job is None:
                return
            del self._entries[key]
            job = entry.job
        self.pool.cancel(job)

    def compile(self, key: GrammarKey, timeout: Optional[float] = None) -> Any:
        """Compile (or fetch) synchronously; ValueError if the constraint is invalid."""
        fut = self.submit(key, count_hit=False)
        try:
            return self.result(key, fut, timeout)
        finally:
            self.release(key)

    def result(self, key: GrammarKey, fut: Future, timeout: Optional[float] = None) -> Any:
        """A finished compile's grammar; its error as a ValueError naming the field."""
        try:
            return fut.result(timeout)
        except CompileCancelledError:
            raise
        except CompileTimeoutError as exc:
            raise ValueError(f"structured_outputs.{key.kind} {exc}") from None
        except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError / ValueError
            raise ValueError(f"structured_outputs.{key.kind} is invalid: {_clean(exc)}") from None

    def _decode(self, text: str) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(text, self._info)

    def _done(self, key: GrammarKey, entry: _Entry) -> None:
        fut = entry.future
        job, entry.job = entry.job, None
        if _cancelled(fut):
            self.stats.cancelled += 1
            with self._lock:
                if self._entries.get(key) is entry:
                    del self._entries[key]
            return
        exc = fut.exception()
        if exc is not None:
            self.stats.failures += 1
            self.stats.timeouts += isinstance(exc, CompileTimeoutError)
        elif job is not None:
            self.stats.observe_compile(job.seconds)
            entry.nbytes = max(1, job.result_bytes)
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            self._bytes += entry.nbytes
            while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
                old = next((k for k, e in self._entries.items() if e.future.done() and k != key), None)
                if old is None:
                    break
                self._bytes -= self._entries.pop(old).nbytes

    def __len__(self) -> int:
        """Grammars cached or compiling."""
        with self._lock:
            return len(self._entries)

    def shutdown(self) -> None:
        """Cancel this cache's compiles still under way (the shared pool serves other engines)."""
        with self._lock:
            self._closed = True
            jobs = [e.job for e in self._entries.values() if e.job is not None and not e.future.done()]
        for job in jobs:
            self.pool.cancel(job)


def _cancelled(fut: Future) -> bool:
    return fut.done() and (fut.cancelled() or isinstance(fut.exception(), CompileCancelledError))
