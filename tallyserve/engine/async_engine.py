"""AsyncLLMEngine: the asynchronous front end, composed like vLLM v1's AsyncLLM.

- an ``InputProcessor`` validates and tokenizes each request on the caller's side (once);
- an ``EngineCoreClient`` carries requests to the engine loop and its products back, over one of two
  transports (core_client.py): ``InprocClient``, the loop on a thread of this process, or ``MPClient``,
  the loop in an engine core process of its own (``--frontend-multiprocessing``);
- the streams: per-request asyncio queues fed once per step with ``loop.call_soon_threadsafe``; a
  beam search group (`beam_search()`) gets one item, its ``BeamSearchOutput``, when it finishes. If the
  loop dies, every pending stream ends at once with ``EngineDeadError`` and new requests are refused.

Outputs are cumulative, so a stream buffers at most one unconsumed RequestOutput: a newer one
replaces it (a client that does not read costs one output, not one per step).

Health (`engine/health.py`) is derived from what the loop publishes on its HealthBoard: alive, the last
heartbeat, the running step (since when, how many tokens) and the seconds-per-token estimate.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

from tallyserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from tallyserve.engine.core_client import EngineCoreClient, InprocClient
from tallyserve.engine.core_loop import BeamRequest
from tallyserve.engine.errors import (EngineDeadError, FaultKind, QueueFullError,  # noqa: F401 - re-exported
                                       RequestRejectedError, StepFailedError)
from tallyserve.engine.health import DEFAULT_STALL_TIMEOUT_S, HealthState
from tallyserve.engine.input_processor import InputProcessor, PromptType
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.outputs import RequestOutput
from tallyserve.sampling_params import SamplingParams
from tallyserve.engine.core_client import MPClient

DEFAULT_SLOW_CLIENT_TIMEOUT_S = 60.0


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
    """``core``: an LLMEngine (run by an InprocClient on a thread of this process) or an
    EngineCoreClient (e.g. ``MPClient(args)``: the loop in its own process)."""

    def __init__(self, core: Union[LLMEngine, EngineCoreClient], stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
                 max_queue_len: Optional[int] = None,
                 slow_client_timeout: Optional[float] = DEFAULT_SLOW_CLIENT_TIMEOUT_S) -> None:
        self.core: EngineCoreClient = core if isinstance(core, EngineCoreClient) else InprocClient(core)
        info = self.core.info
        self.tokenizer = self.core.tokenizer  # this side's own tokenizer (the loop has its own)
        self.served_model_name = info.served_model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_logprobs = info.max_logprobs
        self.block_size = info.block_size
        self.input_processor = InputProcessor(self.tokenizer, info.vocab_size, info.max_model_len, info.max_logprobs,
                                              info.max_num_seqs, self.core.kv_connector)
        # Grammars compiled on this side to answer a constraint that does not compile with a 400.
        self.structured = self.core.structured
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
        self._stats: dict[str, Any] = info.stats
        self._started = False
        self.draining = False
        # Called from the loop's side with the number of tokens each non-empty step scheduled.
        self.step_observer: Optional[Callable[[int], None]] = None

    @classmethod
    def from_engine_args(cls, args: Any, frontend_multiprocessing: bool = False, **kwargs: Any) -> "AsyncLLMEngine":
        if frontend_multiprocessing:
            return cls(MPClient(args, stall_timeout=kwargs.get("stall_timeout", DEFAULT_STALL_TIMEOUT_S)), **kwargs)
        return cls(LLMEngine(args), **kwargs)

    @property
    def kv_connector(self) -> Any:
        """The scheduler half of disaggregated serving (in-thread engines only), or None."""
        return self.core.kv_connector

    def kv_transfer_metadata(self, rank: int) -> Optional[dict]:
        """The NIXL agent metadata consumers fetch for tensor-parallel rank ``rank`` (None without a connector)."""
        return self.core.kv_transfer_metadata(rank)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.core.start(self)

    def shutdown(self, timeout: float = 5.0, reason: str = "the server shut down") -> None:
        """Stop the loop: unfinished requests are aborted and end with EngineDeadError. If the loop
        does not stop within `timeout` (stuck in a step), its requests are failed from here."""
        self.core.shutdown(timeout, reason)
        self._fail_all(reason)

    @property
    def is_running(self) -> bool:
        return self._started and self._dead_reason is None and self.core.is_alive()

    def health(self) -> HealthState:
        with self._lock:
            pending = len(self._streams)
        board = self.core.board
        started = board.step_started  # read once: the loop clears it when the step ends
        now = time.monotonic()
        return HealthState(
            alive=self.is_running,
            draining=self.draining,
            pending=pending,
            seconds_since_heartbeat=now - board.heartbeat,
            stall_timeout=self.stall_timeout,
            dead_reason=self._dead_reason,
            step_running_s=None if started is None else now - started,
            step_tokens=self.core.current_step_tokens() if started is not None else 0,
            seconds_per_token=board.seconds_per_token,
        )

    def stats(self) -> dict[str, Any]:
        """The engine stats the loop last published (never read from the engine here)."""
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
        try:
            request = self.input_processor.process(request_id, prompt, params)
        except ValueError as exc:
            raise RequestRejectedError(str(exc)) from exc
        stream = self._submit(_Stream(request_id, asyncio.get_running_loop()), request)
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
        try:
            _, ids = self.input_processor.process_prompt(prompt)
        except ValueError as exc:
            raise RequestRejectedError(str(exc)) from exc
        stream = self._submit(_Stream(request_id, asyncio.get_running_loop()), BeamRequest(ids, params))
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

    def _submit(self, stream: _Stream, request: Any) -> _Stream:
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
            self.core.put(("add", stream.request_id, request))
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._inbox_times.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            self.core.put(("abort", request_id))

    def inject_fault(self, kind: FaultKind, seconds: float = 0.0) -> None:
        """Test hook: step_exception (next step raises), kill_loop, stall (next step sleeps)."""
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running: {self._dead_reason or 'not started'}")
        self.core.put(("fault", FaultKind(kind), float(seconds)))

    # ----------------------------------------------------------------- what the loop sends (its thread)
    def picked(self, request_id: str) -> None:
        with self._lock:
            self._inbox_times.pop(request_id, None)  # from now on the scheduler counts it

    def publish_stats(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self._stats = snapshot

    def step_tokens(self, tokens: int) -> None:
        if self.step_observer is not None:
            self.step_observer(tokens)

    def flush(self) -> None:
        pass

    def outputs(self, items: list[tuple[str, Any, bool]]) -> None:
        """Hand a step's items to their streams with one wake-up per event loop; items nobody
        listens for (aborted requests) are dropped."""
        batch = []
        with self._lock:
            for rid, item, last in items:
                stream = self._streams.pop(rid, None) if last else self._streams.get(rid)
                if stream is not None:
                    batch.append((stream, item))
        _deliver(batch)

    def dead(self, reason: str) -> None:
        """The loop ended: every stream ends with EngineDeadError; new requests are refused."""
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = reason
            streams = list(self._streams.values())
            self._streams.clear()
            self._inbox_times.clear()
        _deliver([(s, EngineDeadError(f"engine loop is not running: {reason}")) for s in streams])


def _deliver(batch: list[tuple[_Stream, Any]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in batch:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            pass  # that event loop is closed: its consumers are gone


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
