"""The engine core process: the `LLMEngine` step loop in a process of its own (frontend
multiprocessing), so that the server's HTTP and SSE work runs on another GIL.

The loop is AsyncLLMEngine's own (`EngineCoreLoop` subclasses it), run on this process's main
thread; only its edges differ:
- commands (add / abort / fault / stop) arrive over a pipe; a reader thread puts them in the loop's
  inbox exactly as AsyncLLMEngine's event-loop side does;
- what the loop would hand to its streams goes back over another pipe, once per step, as one message:
  per-request deltas (output_delta.py), errors, finished beam searches, the stats snapshot when it
  changed, the tokens of each step (for the tokens-per-step histogram) and the ids of the requests
  the loop picked up from its inbox (for the server's queue count);
- health (heartbeat, the running step's start and tokens, the seconds-per-token estimate) is written
  into shared memory (`HealthBoard`), so the server process reads it without asking, also while a
  step runs;
- the process watches its parent: when the server process goes away (pipe closed, or re-parented),
  the loop stops, and if a step does not end within PARENT_GONE_GRACE_S the process exits anyway.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from tallyserve.engine.async_engine import AsyncLLMEngine, _Stream
from tallyserve.engine.beam_search import BeamSearchOutput
from tallyserve.engine.output_delta import DeltaEncoder
from tallyserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

PARENT_GONE_GRACE_S = 10.0
_WATCH_INTERVAL_S = 0.05

# HealthBoard slots (a shared array of doubles; time.monotonic() is one clock for every process)
HEARTBEAT, STEP_STARTED, STEP_TOKENS, SECONDS_PER_TOKEN = range(4)
HEALTH_SLOTS = 4
STRUCTURED_STATS_KEY = "structured_output_counts"  # in the stats snapshot: (requests by kind, cache hits)


class HealthBoard:
    """The loop's health figures in shared memory: written by the engine core process, read by the
    server process. NaN in STEP_STARTED means no step is running."""

    def __init__(self, array: Any) -> None:
        self.array = array

    @property
    def heartbeat(self) -> float:
        return self.array[HEARTBEAT]

    @property
    def step_started(self) -> Optional[float]:
        v = self.array[STEP_STARTED]
        return None if math.isnan(v) else v

    @property
    def step_tokens(self) -> int:
        return int(self.array[STEP_TOKENS])

    @property
    def seconds_per_token(self) -> float:
        return self.array[SECONDS_PER_TOKEN]


class EngineCoreLoop(AsyncLLMEngine):
    """AsyncLLMEngine's loop with a pipe for an inbox and a pipe for its streams."""

    def __init__(self, engine: Any, board: Any, out_conn: Connection, **kwargs: Any) -> None:
        self._board = board  # before super().__init__: its health attributes write here
        self._board[STEP_STARTED] = math.nan
        self._out = out_conn
        self._send_lock = threading.Lock()
        self._encoder = DeltaEncoder()
        self._outbox: list[tuple] = []
        self._step_tokens: list[int] = []
        self._picked: list[str] = []
        self._sent_stats: Optional[dict] = None
        super().__init__(engine, **kwargs)
        self.step_observer = self._observe_tokens

    # Health attributes live in shared memory (the server process reads them from there).
    @property
    def _heartbeat(self) -> float:  # type: ignore[override]
        return self._board[HEARTBEAT]

    @_heartbeat.setter
    def _heartbeat(self, value: float) -> None:
        self._board[HEARTBEAT] = value

    @property
    def _step_started(self) -> Optional[float]:  # type: ignore[override]
        v = self._board[STEP_STARTED]
        return None if math.isnan(v) else v

    @_step_started.setter
    def _step_started(self, value: Optional[float]) -> None:
        if value is None:
            self._board[STEP_TOKENS] = 0
        self._board[STEP_STARTED] = math.nan if value is None else value

    @property
    def _seconds_per_token(self) -> float:  # type: ignore[override]
        return self._board[SECONDS_PER_TOKEN]

    @_seconds_per_token.setter
    def _seconds_per_token(self, value: float) -> None:
        self._board[SECONDS_PER_TOKEN] = value

    @property
    def is_running(self) -> bool:  # the loop runs on this process's main thread
        return self._dead_reason is None

    # ----------------------------------------------------------------- commands in
    def receive(self, conn: Connection) -> None:
        """Reader thread: commands from the server process into the loop's inbox."""
        reason = "the server process closed its connection"
        try:
            while True:
                cmd = conn.recv()
                kind = cmd[0]
                if kind == "add":
                    with self._lock:
                        self._streams[cmd[1]] = _Stream(cmd[1], None)  # type: ignore[arg-type]
                        self._inbox_times[cmd[1]] = time.monotonic()
                    self._inbox.put(cmd)
                elif kind == "abort":
                    self.abort(cmd[1])
                else:  # fault, stop
                    self._inbox.put(cmd)
                    if kind == "stop":
                        return
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # noqa: BLE001 - a bad message ends the loop, loudly
            logger.exception("engine core: reading a command failed")
            reason = f"reading a command failed: {type(exc).__name__}: {exc}"
        self._inbox.put(("stop", reason))

    def watch(self, parent_pid: int) -> None:
        """Watchdog thread: the running step's tokens into shared memory; stop when the parent goes."""
        while self._dead_reason is None:
            time.sleep(_WATCH_INTERVAL_S)
            if not math.isnan(self._board[STEP_STARTED]):
                self._board[STEP_TOKENS] = self._current_step_tokens()
            if os.getppid() != parent_pid:
                logger.error("engine core: the server process is gone; stopping")
                self._inbox.put(("stop", "the server process is gone"))
                time.sleep(PARENT_GONE_GRACE_S)
                os._exit(1)  # the loop did not stop in time (stuck in a step): no orphan

    # ----------------------------------------------------------------- loop hooks
    def _cmd_add(self, request_id: str, prompt: Any, params: Any) -> None:
        self._picked.append(request_id)
        super()._cmd_add(request_id, prompt, params)

    def _cmd_abort(self, request_id: str) -> None:
        self._encoder.forget(request_id)
        super()._cmd_abort(request_id)

    def _drain_inbox(self, block: bool) -> Optional[str]:
        reason = super()._drain_inbox(block)
        if block or reason is not None:  # idle (a busy loop sends after its step)
            self._send_outbox()
        return reason

    def _publish_stats(self) -> dict[str, Any]:
        stats = super()._publish_stats()
        so = self.engine.structured.manager.stats  # None until a structured-output request built the cache
        if so is not None:  # the server process compiles to validate; requests and hits are counted here
            stats[STRUCTURED_STATS_KEY] = (dict(so.requests), so.cache_hits)
        return stats

    def _dispatch_beams(self) -> None:  # the last thing of every loop iteration
        super()._dispatch_beams()
        self._send_outbox()

    def _deliver(self, batch: list[tuple[_Stream, Any]], finished: bool) -> None:
        if finished:
            with self._lock:
                for stream, _ in batch:
                    self._streams.pop(stream.request_id, None)
        for stream, item in batch:
            rid = stream.request_id
            if isinstance(item, RequestOutput):
                self._outbox.append(("o", self._encoder.encode(item)))
            elif isinstance(item, BaseException):
                self._encoder.forget(rid)
                self._outbox.append(("x", rid, type(item).__name__, str(item)))
            elif isinstance(item, BeamSearchOutput):
                self._outbox.append(("b", rid, item))

    def _send_outbox(self) -> None:
        """One message with everything since the last one (nothing if nothing changed)."""
        stats = self._stats
        new_stats = stats if stats is not self._sent_stats and stats != self._sent_stats else None
        self._sent_stats = stats
        if not (self._outbox or new_stats is not None or self._step_tokens or self._picked):
            return
        msg = ("step", self._outbox, new_stats, self._step_tokens, self._picked)
        self._outbox, self._picked, self._step_tokens = [], [], []
        self._send(msg)

    def _observe_tokens(self, tokens: int) -> None:
        self._step_tokens.append(tokens)

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._out.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self._inbox.put(("stop", "the server process closed its connection"))

    def run_until_stopped(self) -> str:
        try:
            self._run()
        finally:
            reason = self._dead_reason or "stopped"
            try:
                self._send_outbox()  # the requests _fail_all ended
            finally:
                self._send(("dead", reason))
        return reason


def run_engine_core(args: Any, cmd_conn: Connection, out_conn: Connection, board: Any, parent_pid: int,
                    log_level: int, loop_kwargs: dict) -> None:
    """The engine core process's entry point (multiprocessing, spawn context)."""
    # Ctrl-C (SIGINT to the process group) and a SIGTERM to every process of the service (systemd, a
    # process-group kill) are the server's to handle: it drains, then stops this process over the pipe
    # (and kills it if it does not stop). Dying here first would fail the requests being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    from tallyserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(args)
    except BaseException as exc:  # noqa: BLE001 - the server process reports it and exits
        if not isinstance(exc, ValueError):  # bad arguments are the server's to report, without a trace
            logger.exception("engine core: building the engine failed")
        out_conn.send(("failed", isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"))
        return
    loop = EngineCoreLoop(engine, board, out_conn, **loop_kwargs)
    engine.structured.manager.warm_up()  # a compile worker starts now, not with the first request
    out_conn.send(("ready", engine_info(engine, loop)))
    threading.Thread(target=loop.receive, args=(cmd_conn,), name="tallyserve-core-inbox", daemon=True).start()
    threading.Thread(target=loop.watch, args=(parent_pid,), name="tallyserve-core-watch", daemon=True).start()
    reason = loop.run_until_stopped()
    logger.info("engine core stopped: %s", reason)


def engine_info(engine: Any, loop: EngineCoreLoop) -> dict[str, Any]:
    """What the server process needs to know about the engine without having one."""
    import pickle

    try:
        tokenizer = pickle.dumps(engine.tokenizer)
    except Exception:  # noqa: BLE001 - the server process loads it from its path instead
        tokenizer = None
    return dict(served_model_name=engine.served_model_name, max_model_len=loop.max_model_len,
                vocab_size=loop.vocab_size, max_logprobs=loop.max_logprobs, block_size=loop.block_size,
                eos_token_ids=tuple(engine.eos_token_ids), stats=engine.stats(), tokenizer=tokenizer)
