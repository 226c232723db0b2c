"""The engine core process: an EngineLoop (core_loop.py) on this process's main thread, reached by
MPClient (core_client.py) in the server's process.

- commands (add / abort / fault / stop) arrive over a pipe; a reader thread puts them in the loop's inbox;
- what the loop produces goes back over another pipe (`PipeSink`), once per loop iteration, as one
  message: per-request deltas (output_delta.py), errors, finished beam searches, the stats snapshot when
  it changed, the tokens of each step (for the tokens-per-step histogram) and the ids of the requests
  the loop picked up from its inbox (for the server's queue count);
- health is written into shared memory (the HealthBoard), so the server reads it without asking, also
  while a step runs; a watchdog thread copies the running step's tokens there;
- the process watches its parent: when the server process goes away (pipe closed, or re-parented),
  the loop stops, and if a step does not end within PARENT_GONE_GRACE_S the process exits anyway.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from tallyserve.engine.beam_search import BeamSearchOutput
from tallyserve.engine.core_loop import EngineInfo, EngineLoop
from tallyserve.engine.health import HealthBoard
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.engine.output_delta import DeltaEncoder
from tallyserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

PARENT_GONE_GRACE_S = 10.0
_WATCH_INTERVAL_S = 0.05


class PipeSink:
    """The loop's products, batched into one message per loop iteration for the server process."""

    def __init__(self, conn: Connection, inbox: queue.SimpleQueue) -> None:
        self._conn = conn
        self._inbox = inbox  # the loop's: a stop command goes there when the server process is gone
        self._send_lock = threading.Lock()
        self._encoder = DeltaEncoder()
        self._outbox: list[tuple] = []
        self._step_tokens: list[int] = []
        self._picked: list[str] = []
        self._stats: Optional[dict] = None
        self._sent_stats: Optional[dict] = None

    def picked(self, request_id: str) -> None:
        self._picked.append(request_id)

    def outputs(self, items: list[tuple[str, Any, bool]]) -> None:
        for rid, item, _last in items:
            if isinstance(item, RequestOutput):
                self._outbox.append(("o", self._encoder.encode(item)))
            elif isinstance(item, BaseException):
                self._encoder.forget(rid)
                self._outbox.append(("x", rid, type(item).__name__, str(item)))
            elif isinstance(item, BeamSearchOutput):
                self._outbox.append(("b", rid, item))

    def publish_stats(self, snapshot: dict[str, Any]) -> None:
        self._stats = snapshot

    def step_tokens(self, tokens: int) -> None:
        self._step_tokens.append(tokens)

    def flush(self) -> None:
        """One message with everything since the last one (nothing if nothing changed)."""
        stats = self._stats
        new_stats = stats if stats is not self._sent_stats and stats != self._sent_stats else None
        self._sent_stats = stats
        if not (self._outbox or new_stats is not None or self._step_tokens or self._picked):
            return
        msg = ("step", self._outbox, new_stats, self._step_tokens, self._picked)
        self._outbox, self._picked, self._step_tokens = [], [], []
        self.send(msg)

    def dead(self, reason: str) -> None:
        try:
            self.flush()
        finally:
            self.send(("dead", reason))

    def send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self._inbox.put(("stop", "the server process closed its connection"))


def receive(loop: EngineLoop, conn: Connection) -> None:
    """Reader thread: commands from the server process into the loop's inbox."""
    reason = "the server process closed its connection"
    try:
        while True:
            cmd = conn.recv()
            loop.put(cmd)
            if cmd[0] == "stop":
                return
    except (EOFError, OSError):
        pass
    except BaseException as exc:  # noqa: BLE001 - a bad message ends the loop, loudly
        logger.exception("engine core: reading a command failed")
        reason = f"reading a command failed: {type(exc).__name__}: {exc}"
    loop.put(("stop", reason))


def watch(loop: EngineLoop, parent_pid: int, stopped: threading.Event) -> None:
    """Watchdog thread: the running step's tokens into shared memory; stop when the parent goes."""
    board, engine = loop.board, loop.engine
    while not stopped.is_set():
        time.sleep(_WATCH_INTERVAL_S)
        if board.step_started is not None:
            try:
                board.step_tokens = int(engine.current_step_tokens or 0)
            except Exception:  # noqa: BLE001 - a racy read must never end the watchdog
                pass
        if os.getppid() != parent_pid:
            logger.error("engine core: the server process is gone; stopping")
            loop.put(("stop", "the server process is gone"))
            time.sleep(PARENT_GONE_GRACE_S)
            os._exit(1)  # the loop did not stop in time (stuck in a step): no orphan


def run_engine_core(args: Any, cmd_conn: Connection, out_conn: Connection, board_slots: Any, parent_pid: int,
                    log_level: int) -> None:
    """The engine core process's entry point (multiprocessing, spawn context)."""
    # Ctrl-C (SIGINT to the process group) and a SIGTERM to every process of the service (systemd, a
    # process-group kill) are the server's to handle: it drains, then stops this process over the pipe
    # (and kills it if it does not stop). Dying here first would fail the requests being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    try:
        engine = LLMEngine(args)
    except BaseException as exc:  # noqa: BLE001 - the server process reports it and exits
        if not isinstance(exc, ValueError):  # bad arguments are the server's to report, without a trace
            logger.exception("engine core: building the engine failed")
        out_conn.send(("failed", isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"))
        return
    board = HealthBoard(board_slots)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, board, PipeSink(out_conn, inbox), inbox)
    engine.structured.warm_up()  # a compile worker starts now, not with the first request
    try:
        tokenizer = pickle.dumps(engine.tokenizer)
    except Exception:  # noqa: BLE001 - the server process loads it from its path instead
        tokenizer = None
    out_conn.send(("ready", {"info": EngineInfo.of(engine), "tokenizer": tokenizer}))
    stopped = threading.Event()
    threading.Thread(target=receive, args=(loop, cmd_conn), name="tallyserve-core-inbox", daemon=True).start()
    threading.Thread(target=watch, args=(loop, parent_pid, stopped), name="tallyserve-core-watch",
                     daemon=True).start()
    reason = loop.run()
    stopped.set()
    logger.info("engine core stopped: %s", reason)
