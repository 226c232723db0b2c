"""AsyncLLMEngine: the engine in one supervised background thread, per-request asyncio streams.

Only the loop thread ever touches the `LLMEngine`. The event loop talks to it through a
thread-safe inbox (add / abort / fault / stop commands); outputs come back once per step through
`loop.call_soon_threadsafe`; a beam search group (`beam_search()`) gets one item that way, its
`BeamSearchOutput`, when it finishes. If the loop thread dies, every pending stream ends at once
with `EngineDeadError` and new requests are refused. Health is derived from three facts the loop
publishes: it is alive, the time of its last heartbeat (a finished step, or an idle wait), and
whether work is pending.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from tallyserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from tallyserve.engine.llm_engine import LLMEngine, PromptType
from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 5.0
_IDLE_WAIT_S = 0.1  # the idle loop wakes this often to beat its heart


class EngineDeadError(RuntimeError):
    """The loop thread is gone (or stopped); the request cannot be served."""


class RequestRejectedError(ValueError):
    """The engine refused the request (bad prompt, duplicate id, ...): a client error."""


class QueueFullError(RuntimeError):
    """More requests wait than max_queue_len allows."""


class StepFailedError(RuntimeError):
    """An engine step failed; the request ended with finish_reason "error"."""


class FaultKind(str, enum.Enum):
    STEP_EXCEPTION = "step_exception"
    KILL_LOOP = "kill_loop"
    STALL = "stall"


class _LoopKilled(Exception):
    """Raised inside the loop thread by the kill_loop fault."""


@dataclass
class _Stream:
    """Consumer side of one request: an asyncio queue on the caller's event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


@dataclass(frozen=True)
class HealthState:
    alive: bool
    draining: bool
    pending: int
    seconds_since_heartbeat: float
    stall_timeout: float
    dead_reason: Optional[str]

    @property
    def stalled(self) -> bool:
        return self.pending > 0 and self.seconds_since_heartbeat > self.stall_timeout

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and not self.stalled

    @property
    def reason(self) -> str:
        if not self.alive:
            return f"engine loop is not running: {self.dead_reason or 'stopped'}"
        if self.draining:
            return "server is draining for shutdown"
        if self.stalled:
            return (f"engine loop stalled: no step completed for {self.seconds_since_heartbeat:.1f}s "
                    f"with {self.pending} request(s) pending (stall timeout {self.stall_timeout}s)")
        return "ok"


class AsyncLLMEngine:
    """Runs `engine` in a background thread; `generate()` streams its outputs to asyncio callers."""

    def __init__(self, engine: LLMEngine, stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
                 max_queue_len: Optional[int] = None) -> None:
        self.engine = engine
        self.stall_timeout = stall_timeout
        self.max_queue_len = max_queue_len
        # A private tokenizer copy for the event-loop side (the engine's is used by the loop thread).
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.served_model_name = engine.served_model_name
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.max_logprobs = engine.config.args.max_logprobs
        self.block_size = engine.config.cache_config.block_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # guarded by _lock
        # Requests not yet in a published stats snapshot (in the inbox, or added since); _lock.
        self._unadmitted = 0
        self._dead_reason: Optional[str] = None  # set once, under _lock, when the loop ends
        self._admitted = 0  # loop thread only: adds applied since the last snapshot
        self._flush = False  # loop thread only: a cancelled beam group may leave KV copies queued
        self._thread: Optional[threading.Thread] = None
        self._heartbeat = time.monotonic()
        self._stats: dict[str, Any] = engine.stats()
        self.draining = False
        # Called from the loop thread with the number of tokens each non-empty step scheduled.
        self.step_observer: Optional[Callable[[int], None]] = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tallyserve-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0, reason: str = "the server shut down") -> None:
        """Stop the loop: unfinished requests are aborted and end with EngineDeadError. If the loop
        does not stop within `timeout` (stuck in a step), its requests are failed from here."""
        self._inbox.put(("stop", reason))
        if self._thread is not None and self._dead_reason is None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine loop did not stop within %.1fs; failing its requests", timeout)
        self._fail_all(reason)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_reason is None

    def health(self) -> HealthState:
        with self._lock:
            pending = len(self._streams)
        return HealthState(
            alive=self.is_running,
            draining=self.draining,
            pending=pending,
            seconds_since_heartbeat=time.monotonic() - self._heartbeat,
            stall_timeout=self.stall_timeout,
            dead_reason=self._dead_reason,
        )

    def stats(self) -> dict[str, Any]:
        """The engine stats the loop thread last published (never read from the engine here)."""
        return self._stats

    def num_waiting(self) -> int:
        """Requests waiting in the scheduler's last snapshot, plus those submitted since (still in
        the inbox, or added and in their first step): the length of the queue max_queue_len caps."""
        with self._lock:
            return self._num_waiting_locked()

    def _num_waiting_locked(self) -> int:
        return int(self._stats.get("num_waiting", 0)) + self._unadmitted

    # ----------------------------------------------------------------- requests
    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until the request finishes. Closing the iterator early
        (client disconnect, cancellation) aborts the request and returns its blocks."""
        stream = self._submit(_Stream(request_id, asyncio.get_running_loop()), ("add", request_id, prompt, params))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                    if item.error is not None:
                        raise StepFailedError(item.error)
                    yield item
                    return
                yield item
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> BeamSearchOutput:
        """Run one beam search group to the end; its sequences come best first. Raises like
        `generate` (EngineDeadError, QueueFullError, RequestRejectedError, StepFailedError).
        Cancelling the caller (client disconnect) cancels the group and returns its blocks."""
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._submit(stream, ("add", request_id, prompt, params))
        try:
            item = await stream.queue.get()
            stream.finished = True
            if isinstance(item, BaseException):
                raise item
            if getattr(item, "error", None) is not None:
                raise StepFailedError(item.error)
            return item
        finally:
            if not stream.finished:
                self.abort(request_id)

    def _submit(self, stream: _Stream, cmd: tuple) -> _Stream:
        """Admission (live loop, unique id, queue limit) and the add command, atomically."""
        with self._lock:
            if self._dead_reason is not None or not self.is_running:
                raise EngineDeadError(f"engine loop is not running: {self._dead_reason or 'not started'}")
            if stream.request_id in self._streams:
                raise RequestRejectedError(f"request id {stream.request_id!r} is already in use")
            if self.max_queue_len is not None and self._num_waiting_locked() >= self.max_queue_len:
                raise QueueFullError(f"too many requests waiting (max_queue_len is {self.max_queue_len})")
            self._streams[stream.request_id] = stream
            self._unadmitted += 1
            self._inbox.put(cmd)
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            self._inbox.put(("abort", request_id))

    def inject_fault(self, kind: FaultKind, seconds: float = 0.0) -> None:
        """Test hook: step_exception (next step raises), kill_loop, stall (next step sleeps)."""
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running: {self._dead_reason or 'not started'}")
        self._inbox.put(("fault", FaultKind(kind), float(seconds)))

    # ----------------------------------------------------------------- loop thread
    def _run(self) -> None:
        reason = "stopped"
        try:
            reason = self._loop()
        except _LoopKilled:
            reason = "killed by injected fault"
            logger.error("engine loop killed by an injected fault")
        except BaseException as exc:  # noqa: BLE001 - the supervisor must see everything
            reason = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
        finally:
            self._fail_all(reason)

    def _loop(self) -> str:
        """Step while there is work; returns the reason it was asked to stop."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            stop_reason = self._drain_inbox(block=not busy)
            if stop_reason is not None:
                self._stop_engine()
                return stop_reason
            if not engine.has_unfinished_requests() and not self._flush:
                self._heartbeat = time.monotonic()
                continue
            self._flush = False
            before = self._stats.get("scheduled_tokens", 0)
            admitted = self._admitted
            outputs = engine.step()
            self._heartbeat = time.monotonic()
            stats = self._publish_stats(admitted)
            if self.step_observer is not None and stats["scheduled_tokens"] > before:
                self.step_observer(stats["scheduled_tokens"] - before)
            self._dispatch(outputs)
            self._dispatch_beams()

    def _drain_inbox(self, block: bool) -> Optional[str]:
        """Apply queued commands; the reason when asked to stop. Blocks briefly when idle."""
        while True:
            try:
                cmd = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    self._publish_stats(self._admitted)
                return None
            block = False
            if cmd[0] == "stop":
                return cmd[1]
            getattr(self, "_cmd_" + cmd[0])(*cmd[1:])

    def _publish_stats(self, admitted: int) -> dict[str, Any]:
        """New stats snapshot; `admitted` requests added before it are now counted in it."""
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
            self._unadmitted -= admitted
        self._admitted -= admitted
        return stats

    def _cmd_add(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> None:
        self._admitted += 1  # leaves _unadmitted at the next snapshot
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted before it was admitted
        try:
            if isinstance(params, BeamSearchParams):
                self.engine.add_beam_search_request(request_id, prompt, params)
            else:
                self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:
            self._deliver([(stream, RequestRejectedError(str(exc)))], finished=True)

    def _cmd_abort(self, request_id: str) -> None:
        if not self._cancel_beam_group(request_id):
            self.engine.abort_request(request_id)

    def _cancel_beam_group(self, group_id: str) -> bool:
        """End a running beam search group (client gone, shutdown): its beams are aborted and their
        blocks freed, the group dropped. False if `group_id` is no beam search group."""
        if not self.engine.beams.abort(group_id):
            return False
        self._flush = True  # forks since the last step pinned copy sources: one (empty) step frees them
        return True

    def _cmd_fault(self, kind: FaultKind, seconds: float) -> None:
        logger.warning("injecting fault %s", kind.value)
        if kind is FaultKind.KILL_LOOP:
            raise _LoopKilled()

        def once(_so: Any) -> None:
            self.engine.fault_injector = None
            if kind is FaultKind.STALL:
                time.sleep(seconds)
            else:
                raise RuntimeError("injected step exception")

        self.engine.fault_injector = once

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        batch = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted: nobody listens
                if out.finished:
                    del self._streams[out.request_id]
                batch.append((stream, out))
        self._deliver(batch, finished=False)

    def _dispatch_beams(self) -> None:
        """Hand finished beam search groups to their waiters (outputs nobody waits for are dropped)."""
        finished = self.engine.beams.outputs
        if not finished:
            return
        batch = []
        with self._lock:
            for gid in list(finished):
                out = finished.pop(gid)
                stream = self._streams.pop(gid, None)
                if stream is not None:
                    batch.append((stream, out))
        self._deliver(batch, finished=False)

    def _deliver(self, batch: list[tuple[_Stream, Any]], finished: bool) -> None:
        """Hand items to their streams with one wake-up per event loop."""
        if finished:
            with self._lock:
                for stream, _ in batch:
                    self._streams.pop(stream.request_id, None)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: its consumers are gone

    def _stop_engine(self) -> None:
        with self._lock:
            ids = list(self._streams)
        ids = [rid for rid in ids if not self._cancel_beam_group(rid)]
        if ids:
            self.engine.abort_request(ids)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = reason
            streams = list(self._streams.values())
            self._streams.clear()
            self._unadmitted = 0
        self._deliver([(s, EngineDeadError(f"engine loop is not running: {reason}")) for s in streams],
                      finished=False)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
