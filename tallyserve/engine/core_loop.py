"""EngineLoop: the one loop that runs an LLMEngine, on a thread of the server's process (InprocClient)
or on the main thread of the engine core process (MPClient, core_proc.py).

Only the loop touches the engine. Commands arrive in its inbox (thread-safe): ``("add", request_id,
EngineCoreRequest | BeamRequest)``, ``("abort", request_id)``, ``("fault", FaultKind, seconds)``,
``("stop", reason)``. What the loop produces goes to its ``OutputSink``, the only difference between the
two placements: the front end's streams in-thread, a pipe to the server process otherwise. Health goes
to a ``HealthBoard`` (a list in-thread, shared memory across processes).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from tallyserve.engine.beam_search import BeamSearchParams
from tallyserve.engine.errors import FaultKind, RequestRejectedError, StepFailedError
from tallyserve.engine.gc_heap import frozen_heap
from tallyserve.engine.health import HealthBoard
from tallyserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # the idle loop wakes this often to beat its heart


@dataclass
class BeamRequest:
    """A beam search group's request: its prompt's token ids (checked by the InputProcessor)."""

    prompt_token_ids: list[int]
    params: BeamSearchParams


@dataclass(frozen=True)
class EngineInfo:
    """What the front end knows about the engine without touching it."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_dir: Optional[str]
    stats: dict

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        cfg = engine.config
        return cls(engine.served_model_name, cfg.scheduler_config.max_model_len, engine.model_config.vocab_size,
                   cfg.args.max_logprobs, cfg.scheduler_config.max_num_seqs, cfg.cache_config.block_size,
                   tuple(engine.eos_token_ids), getattr(engine.resolved, "tokenizer_dir", None), engine.stats())


class OutputSink(Protocol):
    """Where the loop's products go. Called on the loop's thread only."""

    def picked(self, request_id: str) -> None:
        """The loop took the request from its inbox (from now on the scheduler counts it)."""

    def outputs(self, items: list[tuple[str, Any, bool]]) -> None:
        """(request id, RequestOutput | BeamSearchOutput | exception, whether it is the last) of one step."""

    def publish_stats(self, snapshot: dict[str, Any]) -> None:
        """A new stats snapshot of the engine."""

    def step_tokens(self, tokens: int) -> None:
        """A non-empty step ran, scheduling this many tokens."""

    def flush(self) -> None:
        """The end of a loop iteration (or an idle wake-up): a batching sink sends now."""

    def dead(self, reason: str) -> None:
        """The loop ended (after its last outputs)."""


class LoopKilled(Exception):
    """Raised inside the loop by the kill_loop fault."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, board: HealthBoard, sink: OutputSink,
                 inbox: Optional[queue.SimpleQueue] = None) -> None:
        self.engine = engine
        self.board = board
        self.sink = sink
        self.inbox: queue.SimpleQueue = inbox if inbox is not None else queue.SimpleQueue()
        self._flush_kv = False  # a cancelled beam group may leave KV copies queued: one (empty) step frees them
        self._last_stats: dict[str, Any] = engine.stats()

    def put(self, cmd: tuple) -> None:
        """Queue a command (any thread)."""
        self.inbox.put(cmd)

    def run(self) -> str:
        """Step until asked to stop, or until the loop dies; returns why. The engine is shut down
        on the way out (tensor-parallel workers go with the loop: no orphan processes)."""
        reason = "stopped"
        try:
            with frozen_heap():
                reason = self._loop()
        except LoopKilled:
            reason = "killed by injected fault"
            logger.error("engine loop killed by an injected fault")
        except BaseException as exc:  # noqa: BLE001 - the supervisor must see everything
            reason = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
        finally:
            try:
                self.sink.dead(reason)
            finally:
                self._shutdown_engine()
        return reason

    def _shutdown_engine(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - already stopping; say so and go
            logger.exception("shutting down the executor failed")

    def _loop(self) -> str:
        engine, board = self.engine, self.board
        while True:
            busy = engine.has_unfinished_requests()
            stop_reason = self._drain_inbox(block=not busy)
            if stop_reason is not None:
                engine.abort_all()
                return stop_reason
            if not engine.has_unfinished_requests() and not self._flush_kv:
                engine.check_health()  # idle: a dead tensor-parallel worker still ends the loop (and /health)
                board.beat()
                continue
            self._flush_kv = False
            before = self._last_stats.get("scheduled_tokens", 0)
            started = board.step_begins()
            try:
                outputs = engine.step()
            finally:
                board.step_ends()
            stats = self._publish_stats()
            tokens = stats["scheduled_tokens"] - before
            if tokens > 0:
                board.observe_step(board.heartbeat - started, tokens)
                self.sink.step_tokens(tokens)
            items = [(out.request_id, out, out.finished) for out in outputs]
            finished_beams = engine.beams.outputs
            for gid in list(finished_beams):
                items.append((gid, finished_beams.pop(gid), True))
            if items:
                self.sink.outputs(items)
            self.sink.flush()

    def _drain_inbox(self, block: bool) -> Optional[str]:
        """Apply queued commands; the reason when asked to stop. Blocks briefly when idle."""
        while True:
            try:
                cmd = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block:
                    self._publish_stats()
                    self.sink.flush()
                return None
            block = False
            kind = cmd[0]
            if kind == "stop":
                return cmd[1]
            if kind == "add":
                self._add(cmd[1], cmd[2])
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "fault":
                self._fault(cmd[1], cmd[2])
            else:
                logger.error("engine loop: unknown command %r", kind)

    def _publish_stats(self) -> dict[str, Any]:
        stats = self._last_stats = self.engine.stats()
        self.sink.publish_stats(stats)
        return stats

    def _add(self, request_id: str, request: Any) -> None:
        self.sink.picked(request_id)
        try:
            if isinstance(request, BeamRequest):
                self.engine.add_beam_search_request(request_id, request.prompt_token_ids, request.params)
            else:
                self.engine.add_core_request(request)
        except ValueError as exc:
            self.sink.outputs([(request_id, RequestRejectedError(str(exc)), True)])
        except Exception as exc:  # noqa: BLE001 - a request that breaks admission ends itself, not the loop
            logger.error("adding request %s failed", request_id, exc_info=exc)
            self.engine.abort_request(request_id)
            self.sink.outputs([(request_id, StepFailedError(f"{type(exc).__name__}: {exc}"), True)])

    def _abort(self, request_id: str) -> None:
        if self.engine.beams.abort(request_id):  # a beam search group: its beams end, their blocks go
            self._flush_kv = True  # forks since the last step pinned copy sources: one (empty) step frees them
        else:
            self.engine.abort_request(request_id)

    def _fault(self, kind: FaultKind, seconds: float) -> None:
        logger.warning("injecting fault %s", kind.value)
        if kind is FaultKind.KILL_LOOP:
            raise LoopKilled()
        engine = self.engine

        def once(_so: Any) -> None:
            engine.fault_injector = None
            if kind is FaultKind.STALL:
                time.sleep(seconds)
            else:
                raise RuntimeError("injected step exception")

        engine.fault_injector = once

