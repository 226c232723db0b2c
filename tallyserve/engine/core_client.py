"""EngineCoreClient: how the front end (AsyncLLMEngine) reaches the engine loop, one interface over
two transports.

- ``InprocClient(engine)``: the loop (core_loop.EngineLoop) on a thread of this process; its sink is
  the front end itself.
- ``MPClient(args)``: the loop in an engine core process of its own (core_proc.py, spawn context), so
  the server's HTTP and SSE work runs on another GIL. Commands go over a pipe; a reader thread receives
  one message per step, rebuilds the cumulative RequestOutputs from their deltas (output_delta.py) and
  hands them to the front end as the in-thread loop does. Health comes from the shared memory the
  engine core process writes (a HealthBoard), so stall detection works as in-thread; if the process
  dies, the reader sees its pipe close and the front end fails every stream with EngineDeadError. The
  process is stopped by `shutdown` (and at interpreter exit), and it watches this process itself, so
  it never outlives the server.

Either way the client gives the front end: `info` (EngineInfo), a `tokenizer` of its own, the
`structured` manager that compiles grammars to validate requests, `kv_connector` (in-thread only),
the `board`, and `start(sink)` / `put(cmd)` / `is_alive()` / `current_step_tokens()` / `shutdown()`.
"""

from __future__ import annotations

import atexit
import copy
import logging
import multiprocessing
import os
import pickle
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Optional

from tallyserve.engine.core_loop import EngineInfo, EngineLoop, OutputSink
from tallyserve.engine.core_proc import run_engine_core
from tallyserve.engine.errors import EngineDeadError, QueueFullError, RequestRejectedError, StepFailedError
from tallyserve.engine.health import HEALTH_SLOTS, HealthBoard
from tallyserve.engine.llm_engine import LLMEngine
from tallyserve.engine.output_delta import DeltaDecoder
from tallyserve.runner.cpu_threads import release_openmp_workers
from tallyserve.structured_output.limits import StructuredOutputsLimits
from tallyserve.structured_output.manager import STRUCTURED_STATS_KEY, StructuredOutputManager
from tallyserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_ERRORS = {cls.__name__: cls for cls in (EngineDeadError, RequestRejectedError, StepFailedError, QueueFullError)}
_KILL_AFTER_S = 2.0  # how long to wait for a killed engine core process to be gone
_EXIT_GRACE_S = 2.0  # for the engine core process to exit once its loop has stopped


class EngineCoreClient(ABC):
    info: EngineInfo
    tokenizer: Any  # the front end's own copy (the loop uses the engine's)
    structured: StructuredOutputManager  # compiles grammars to validate requests (thread-safe)
    kv_connector: Any = None  # the scheduler half of disaggregated serving (in-thread engines only)
    board: HealthBoard

    @abstractmethod
    def start(self, sink: OutputSink) -> None:
        """Start the loop's side; from now on what it produces goes to ``sink`` (and ``sink.dead``
        once, when it ends)."""

    @abstractmethod
    def put(self, cmd: tuple) -> None:
        """Send a command to the loop (core_loop.py lists them)."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the loop's side still runs."""

    @abstractmethod
    def current_step_tokens(self) -> int:
        """Tokens the running step scheduled (0 if none runs or it is not known)."""

    @abstractmethod
    def shutdown(self, timeout: float, reason: str) -> None:
        """Stop the loop (its requests are aborted), waiting at most ``timeout``."""

    def kv_transfer_metadata(self, rank: int) -> Optional[dict]:
        """Disaggregated serving: the NIXL agent metadata of tensor-parallel rank ``rank`` (in-thread only)."""
        return None


class InprocClient(EngineCoreClient):
    """The loop on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the event loop's side never shares the loop's
        self.structured = engine.structured
        self.kv_connector = engine.kv_connector
        self.board = HealthBoard()
        self._loop: Optional[EngineLoop] = None
        self._thread: Optional[threading.Thread] = None

    def start(self, sink: OutputSink) -> None:
        self.board.beat()
        # Forward passes run on the loop thread from now on; this thread's OpenMP workers would only make
        # the loop thread's sleep between operators instead of spinning (see runner/cpu_threads.py).
        release_openmp_workers()
        self._loop = EngineLoop(self.engine, self.board, sink)
        self._thread = threading.Thread(target=self._loop.run, name="tallyserve-engine-loop", daemon=True)
        self._thread.start()

    def put(self, cmd: tuple) -> None:
        if self._loop is not None:
            self._loop.put(cmd)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def current_step_tokens(self) -> int:
        try:
            return int(self.engine.current_step_tokens or 0)
        except Exception:  # noqa: BLE001 - a racy read from this thread must never fail /health
            return 0

    def kv_transfer_metadata(self, rank: int) -> Optional[dict]:
        return self.engine.executor.kv_transfer_metadata(rank)

    def shutdown(self, timeout: float, reason: str) -> None:
        self.structured.shutdown()  # compiles under way are cancelled, not waited for
        self.put(("stop", reason))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine loop did not stop within %.1fs; failing its requests", timeout)


class _Pipe:
    """The command pipe's sending end, shared by the event loop's and the reader's threads."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, cmd: tuple) -> None:
        try:
            with self._lock:
                self._conn.send(cmd)
        except (BrokenPipeError, EOFError, OSError):
            pass  # the engine core is gone: the reader thread fails every stream

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class MPClient(EngineCoreClient):
    """The loop in an engine core process built from ``args`` (an EngineArgs)."""

    def __init__(self, args: Any, stall_timeout: Optional[float] = None) -> None:
        del stall_timeout  # the front end applies it; the engine core only publishes its health
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self.board = HealthBoard(ctx.RawArray("d", HEALTH_SLOTS))  # lock-free: single writer, float slots
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine_core, name="tallyserve-engine-core",
                                args=(args, cmd_recv, out_send, self.board.slots, os.getpid(),
                                      logging.getLogger().getEffectiveLevel()))
        self.proc.start()
        cmd_recv.close()
        out_send.close()  # the engine core holds the only write end: its exit closes our read end
        self._cmd = _Pipe(cmd_send)
        self._out = out_recv
        self._decoder = DeltaDecoder()
        self._thread: Optional[threading.Thread] = None
        atexit.register(self._stop_at_exit)
        try:
            ready = self._wait_ready()
        except BaseException:
            self._stop_process(_EXIT_GRACE_S)
            raise
        self.info: EngineInfo = ready["info"]
        self.tokenizer = _load_tokenizer(ready.get("tokenizer"), self.info.tokenizer_dir)
        self.structured = StructuredOutputManager(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                                                  limits=StructuredOutputsLimits.from_args(args))
        self.kv_connector = None  # disaggregated serving runs in-thread

    @property
    def pid(self) -> Optional[int]:
        """The engine core process's id."""
        return self.proc.pid

    def _wait_ready(self) -> dict[str, Any]:
        while not self._out.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self.proc.exitcode} while starting")
        try:
            msg = self._out.recv()
        except EOFError as exc:
            self.proc.join(5.0)
            raise RuntimeError(f"the engine core process exited with code {self.proc.exitcode} while starting") \
                from exc
        if msg[0] == "failed":
            if msg[1]:  # bad engine arguments: a ValueError, as the in-thread engine raises
                raise ValueError(msg[2].removeprefix("ValueError: "))
            raise RuntimeError(f"building the engine failed (in the engine core process): {msg[2]}")
        return msg[1]

    # ----------------------------------------------------------------- the interface
    def start(self, sink: OutputSink) -> None:
        self._thread = threading.Thread(target=self._read, args=(sink,), name="tallyserve-core-reader", daemon=True)
        self._thread.start()

    def put(self, cmd: tuple) -> None:
        self._cmd.send(cmd)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def current_step_tokens(self) -> int:
        return self.board.step_tokens

    def shutdown(self, timeout: float, reason: str) -> None:
        """Stop the engine core. If it has not stopped within `timeout` (stuck in a step), it is killed."""
        deadline = time.monotonic() + timeout
        self.structured.shutdown()  # validation compiles: cancelled, their workers killed
        self.put(("stop", reason))
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_process(max(deadline - time.monotonic(), _EXIT_GRACE_S))

    # ----------------------------------------------------------------- the process
    def _stop_process(self, wait: float) -> None:
        proc = self.proc
        proc.join(wait)
        if proc.is_alive():  # it ignores SIGTERM (the server drains first): kill it
            logger.error("the engine core process did not stop; killing it")
            proc.kill()
            proc.join(_KILL_AFTER_S)
        self._cmd.close()

    def _stop_at_exit(self) -> None:
        if self.proc.is_alive():
            self.put(("stop", "the server process exited"))
            self._stop_process(_KILL_AFTER_S)

    # ----------------------------------------------------------------- reader thread
    def _read(self, sink: OutputSink) -> None:
        reason: Optional[str] = None
        try:
            while True:
                msg = self._out.recv()
                if msg[0] == "step":
                    self._on_step(sink, *msg[1:])
                elif msg[0] == "dead":
                    reason = msg[1]
                    break
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # noqa: BLE001 - a reader that dies must still end every stream
            logger.exception("reading from the engine core process failed")
            reason = f"reading from the engine core process failed: {type(exc).__name__}: {exc}"
        if reason is None:
            self.proc.join(1.0)
            reason = f"the engine core process died (exit code {self.proc.exitcode})"
            logger.error("%s", reason)
        sink.dead(reason)

    def _on_step(self, sink: OutputSink, items: list[tuple], stats: Optional[dict], step_tokens: list[int],
                 picked: list[str]) -> None:
        for rid in picked:
            sink.picked(rid)
        if stats is not None:
            counts = stats.get(STRUCTURED_STATS_KEY)
            if counts is not None:
                self.structured.merge_counts(*counts)
            sink.publish_stats(stats)
        for tokens in step_tokens:
            sink.step_tokens(tokens)
        decoded = []
        for item in items:
            if item[0] == "o":
                out = self._decoder.decode(item[1])
                if out is not None:
                    if out.finished:
                        self._decoder.forget(out.request_id)
                    decoded.append((out.request_id, out, out.finished))
            elif item[0] == "x":
                self._decoder.forget(item[1])
                decoded.append((item[1], _ERRORS.get(item[2], StepFailedError)(item[3]), True))
            else:  # "b": a finished beam search
                decoded.append((item[1], item[2], True))
        if decoded:
            sink.outputs(decoded)


def _load_tokenizer(pickled: Optional[bytes], tokenizer_dir: Optional[str]) -> Any:
    if pickled is not None:
        try:
            return pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - load it from its files instead
            logger.warning("the engine's tokenizer did not unpickle; loading it from its files")
    return load_tokenizer(tokenizer_dir)
