"""AsyncLLMEngine: the engine in one supervised background thread, per-request asyncio streams.

Only the loop thread ever touches the `LLMEngine`. The event loop talks to it through a
thread-safe inbox (add / abort / fault / stop commands); outputs come back once per step through
`loop.call_soon_threadsafe`; a beam search group (`beam_search()`) gets one item that way, its
`BeamSearchOutput`, when it finishes. If the loop thread dies, every pending stream ends at once
with `EngineDeadError` and new requests are refused.

Outputs are cumulative, so a stream buffers at most one unconsumed RequestOutput: a newer one
replaces it (a client that does not read costs one output, not one per step).

Health (`engine/health.py`) is derived from what the loop publishes: alive, the last heartbeat,
the running step (since when, how many tokens) and the seconds-per-token estimate of finished steps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from tallyserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from tallyserve.engine.errors import (EngineDeadError, FaultKind, QueueFullError,  # noqa: F401 - re-exported
                                       RequestRejectedError, StepFailedError)
from tallyserve.engine.health import (DEFAULT_STALL_TIMEOUT_S, EMA_ALPHA, EMA_MAX_JUMP, SEED_SECONDS_PER_TOKEN,
                                      HealthState)
from tallyserve.engine.gc_heap import frozen_heap
from tallyserve.engine.llm_engine import LLMEngine, PromptType
from tallyserve.outputs import RequestOutput
from tallyserve.runner.cpu_threads import release_openmp_workers
from tallyserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_SLOW_CLIENT_TIMEOUT_S = 60.0
_IDLE_WAIT_S = 0.1  # the idle loop wakes this often to beat its heart


class _LoopKilled(Exception):
    """Raised inside the loop thread by the kill_loop fault."""


class _OutputQueue(asyncio.Queue):
    """A stream's queue. RequestOutputs are cumulative, so a new one replaces an unconsumed one
    still queued (unless that one is final): a consumer that does not keep up holds one output,
    not one per step, and still gets every token (deltas are taken from the cumulative text).
    Exceptions, outputs with an error, final outputs and beam search results are never replaced,
    and order is kept (a replacement takes the replaced item's place, the last one)."""

    def _put(self, item: Any) -> None:
        q = self._queue  # type: ignore[attr-defined]
        if (q and isinstance(item, RequestOutput) and item.error is None
                and isinstance(q[-1], RequestOutput) and not q[-1].finished and q[-1].error is None):
            q[-1] = item
        else:
            q.append(item)


@dataclass
class _Stream:
    """Consumer side of one request: an asyncio queue on the caller's event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=_OutputQueue)
    finished: bool = False


class AsyncLLMEngine:
    """Runs `engine` in a background thread; `generate()` streams its outputs to asyncio callers."""

    def __init__(self, engine: LLMEngine, stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
                 max_queue_len: Optional[int] = None,
                 slow_client_timeout: Optional[float] = DEFAULT_SLOW_CLIENT_TIMEOUT_S) -> None:
        self.engine = engine
        self._init_streams(stall_timeout, max_queue_len, slow_client_timeout)
        # A private tokenizer copy for the event-loop side (the engine's is used by the loop thread).
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.served_model_name = engine.served_model_name
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.max_logprobs = engine.config.args.max_logprobs
        self.block_size = engine.config.cache_config.block_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._flush = False  # loop thread only: a cancelled beam group may leave KV copies queued
        self._heartbeat = time.monotonic()
        self._step_started: Optional[float] = None  # loop thread writes: when the running step began
        self._seconds_per_token = SEED_SECONDS_PER_TOKEN  # loop thread writes: EMA over finished steps
        self._stats: dict[str, Any] = engine.stats()

    def _init_streams(self, stall_timeout: float, max_queue_len: Optional[int],
                      slow_client_timeout: Optional[float]) -> None:
        """The caller-side state: limits, streams, admission bookkeeping (also EngineCoreClient's,
        whose engine runs in another process)."""
        self.stall_timeout = stall_timeout
        self.max_queue_len = max_queue_len
        # Read by the server's SSE responses: a stream whose client does not read for this long is
        # aborted (None: never).
        self.slow_client_timeout = slow_client_timeout
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # guarded by _lock
        # Submit time of each request in the inbox, oldest first, until the loop picks it up; _lock.
        self._inbox_times: dict[str, float] = {}
        self._dead_reason: Optional[str] = None  # set once, under _lock, when the loop ends
        self._thread: Optional[threading.Thread] = None
        self.draining = False
        # Called from the loop thread with the number of tokens each non-empty step scheduled.
        self.step_observer: Optional[Callable[[int], None]] = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._heartbeat = time.monotonic()
        # Forward passes run on the loop thread from now on; this thread's OpenMP workers would only make
        # the loop thread's sleep between operators instead of spinning (see runner/cpu_threads.py).
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="tallyserve-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0, reason: str = "the server shut down") -> None:
        """Stop the loop: unfinished requests are aborted and end with EngineDeadError. If the loop
        does not stop within `timeout` (stuck in a step), its requests are failed from here."""
        self.engine.structured.manager.shutdown()  # compiles under way are cancelled, not waited for
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
        started = self._step_started  # read once: the loop thread clears it when the step ends
        now = time.monotonic()
        return HealthState(
            alive=self.is_running,
            draining=self.draining,
            pending=pending,
            seconds_since_heartbeat=now - self._heartbeat,
            stall_timeout=self.stall_timeout,
            dead_reason=self._dead_reason,
            step_running_s=None if started is None else now - started,
            step_tokens=self._current_step_tokens() if started is not None else 0,
            seconds_per_token=self._seconds_per_token,
        )

    def _current_step_tokens(self) -> int:
        """Tokens the running step scheduled, as the engine publishes them (0 if it does not)."""
        try:
            return int(getattr(self.engine, "current_step_tokens", 0) or 0)
        except Exception:  # noqa: BLE001 - a racy read from this thread must never fail /health
            return 0

    def stats(self) -> dict[str, Any]:
        """The engine stats the loop thread last published (never read from the engine here)."""
        return self._stats

    def num_waiting(self) -> int:
        """The length of the queue max_queue_len caps: requests waiting for KV blocks or token
        budget (the scheduler's waiting queue in the loop's last snapshot). Requests the loop has
        not picked up yet count only once they have sat in its inbox for the stall window, or while
        health says stalled, so a burst against an idle engine is admitted but a stuck loop cannot
        take unbounded work."""
        stalled = self.health().stalled
        with self._lock:
            return self._num_waiting_locked(stalled)

    def _num_waiting_locked(self, stalled: bool) -> int:
        waiting = int(self._stats.get("num_waiting", 0))
        if stalled:
            return waiting + len(self._inbox_times)
        cutoff = time.monotonic() - self.stall_timeout
        for submitted in self._inbox_times.values():  # oldest first
            if submitted > cutoff:
                break
            waiting += 1
        return waiting

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
        stalled = self.max_queue_len is not None and self.health().stalled
        with self._lock:
            if self._dead_reason is not None or not self.is_running:
                raise EngineDeadError(f"engine loop is not running: {self._dead_reason or 'not started'}")
            if stream.request_id in self._streams:
                raise RequestRejectedError(f"request id {stream.request_id!r} is already in use")
            if self.max_queue_len is not None and self._num_waiting_locked(stalled) >= self.max_queue_len:
                raise QueueFullError(f"too many requests waiting (max_queue_len is {self.max_queue_len})")
            self._streams[stream.request_id] = stream
            self._inbox_times[stream.request_id] = time.monotonic()
            self._inbox.put(cmd)
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._inbox_times.pop(request_id, None)
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
            with frozen_heap():
                reason = self._loop()
        except _LoopKilled:
            reason = "killed by injected fault"
            logger.error("engine loop killed by an injected fault")
        except BaseException as exc:  # noqa: BLE001 - the supervisor must see everything
            reason = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
        finally:
            self._fail_all(reason)
            try:  # tensor-parallel workers go with the loop (no orphan processes)
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 - already stopping; say so and go
                logger.exception("shutting down the executor failed")

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
                engine.check_health()  # idle: a dead tensor-parallel worker still ends the loop (and /health)
                self._heartbeat = time.monotonic()
                continue
            self._flush = False
            before = self._stats.get("scheduled_tokens", 0)
            started = self._step_started = time.monotonic()
            try:
                outputs = engine.step()
            finally:
                self._heartbeat = time.monotonic()
                self._step_started = None
            stats = self._publish_stats()
            tokens = stats["scheduled_tokens"] - before
            if tokens > 0:
                self._observe_step(self._heartbeat - started, tokens)
                if self.step_observer is not None:
                    self.step_observer(tokens)
            self._dispatch(outputs)
            self._dispatch_beams()

    def _observe_step(self, seconds: float, tokens: int) -> None:
        """Fold a finished step into the seconds-per-token average the stall rule predicts with.
        One sample moves it up by at most EMA_MAX_JUMP x, so a stalled step barely skews it."""
        sample = min(seconds / tokens, EMA_MAX_JUMP * self._seconds_per_token)
        self._seconds_per_token += EMA_ALPHA * (sample - self._seconds_per_token)

    def _drain_inbox(self, block: bool) -> Optional[str]:
        """Apply queued commands; the reason when asked to stop. Blocks briefly when idle."""
        while True:
            try:
                cmd = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    self._publish_stats()
                return None
            block = False
            if cmd[0] == "stop":
                return cmd[1]
            getattr(self, "_cmd_" + cmd[0])(*cmd[1:])

    def _publish_stats(self) -> dict[str, Any]:
        """A new stats snapshot (what num_waiting and /metrics read)."""
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
        return stats

    def _cmd_add(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> None:
        with self._lock:
            self._inbox_times.pop(request_id, None)  # picked up: from now on the scheduler counts it
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
        except Exception as exc:  # noqa: BLE001 - a request that breaks admission ends itself, not the loop
            logger.error("adding request %s failed", request_id, exc_info=exc)
            self.engine.abort_request(request_id)
            self._deliver([(stream, StepFailedError(f"{type(exc).__name__}: {exc}"))], finished=True)

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
            self._inbox_times.clear()
        self._deliver([(s, EngineDeadError(f"engine loop is not running: {reason}")) for s in streams],
                      finished=False)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
