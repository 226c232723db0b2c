"""EngineCoreClient: the server's engine when the step loop runs in its own process.

It has AsyncLLMEngine's interface (it subclasses it: `generate`, `beam_search`, `abort`, admission,
the queue count, `health()`, `stats()`, `inject_fault`, `shutdown`, `is_running`, `draining`, the
tokenizer and the limits the server checks requests against), but the `LLMEngine` lives in the
engine core process (`core_proc.py`, started with the spawn context). Here:
- commands go to the engine core process over a pipe (`_inbox.put` sends them);
- a reader thread receives one message per step, rebuilds the cumulative RequestOutputs from the
  deltas (output_delta.py) and hands them to the streams, exactly as the loop thread does in-thread;
- health comes from the shared memory the engine core process writes (heartbeat, running step,
  seconds per token), so stall detection works as in-thread; if the process dies, the reader sees its
  pipe close, every stream ends with EngineDeadError and /health turns unhealthy;
- the process is stopped by `shutdown` (and at interpreter exit), and it watches this process itself,
  so it never outlives the server.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import os
import pickle
import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

from tallyserve.engine.async_engine import DEFAULT_SLOW_CLIENT_TIMEOUT_S, AsyncLLMEngine
from tallyserve.engine.core_proc import (HEALTH_SLOTS, HEARTBEAT, SECONDS_PER_TOKEN, STEP_STARTED, STEP_TOKENS,
                                         STRUCTURED_STATS_KEY, run_engine_core)
from tallyserve.engine.errors import EngineDeadError, QueueFullError, RequestRejectedError, StepFailedError
from tallyserve.engine.health import DEFAULT_STALL_TIMEOUT_S, SEED_SECONDS_PER_TOKEN
from tallyserve.engine.output_delta import DeltaDecoder

logger = logging.getLogger(__name__)

_ERRORS = {cls.__name__: cls for cls in (EngineDeadError, RequestRejectedError, StepFailedError, QueueFullError)}
_KILL_AFTER_S = 2.0  # how long to wait for a killed engine core process to be gone
_EXIT_GRACE_S = 2.0  # for the engine core process to exit once its loop has stopped


class _PipeInbox:
    """The loop's inbox as seen from this process: put() sends the command to the engine core."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def put(self, cmd: tuple) -> None:
        try:
            with self._lock:
                self._conn.send(cmd)
        except (BrokenPipeError, EOFError, OSError):
            pass  # the engine core is gone: the reader thread fails every stream

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class EngineCoreClient(AsyncLLMEngine):
    """AsyncLLMEngine's interface over an engine core process built from `args` (an EngineArgs)."""

    def __init__(self, args: Any, stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
                 max_queue_len: Optional[int] = None,
                 slow_client_timeout: Optional[float] = DEFAULT_SLOW_CLIENT_TIMEOUT_S) -> None:
        # No AsyncLLMEngine.__init__ (it needs an engine): its caller-side state only.
        self._init_streams(stall_timeout, max_queue_len, slow_client_timeout)
        self._decoder = DeltaDecoder()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._board = ctx.RawArray("d", HEALTH_SLOTS)  # lock-free: single writer, float slots
        self._board[STEP_STARTED] = math.nan
        self._board[SECONDS_PER_TOKEN] = SEED_SECONDS_PER_TOKEN
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_engine_core, name="tallyserve-engine-core",
                                 args=(args, cmd_recv, out_send, self._board, os.getpid(),
                                       logging.getLogger().getEffectiveLevel(), {"stall_timeout": stall_timeout}))
        self._proc.start()
        cmd_recv.close()
        out_send.close()  # the engine core holds the only write end: its exit closes our read end
        self._inbox = _PipeInbox(cmd_send)  # type: ignore[assignment]
        self._out = out_recv
        atexit.register(self._stop_at_exit)
        try:
            info = self._wait_ready()
        except BaseException:
            self._stop_process(_EXIT_GRACE_S)
            raise
        self.served_model_name = info["served_model_name"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.max_logprobs = info["max_logprobs"]
        self.block_size = info["block_size"]
        self._stats = info["stats"]
        self.tokenizer = _load_tokenizer(info, args)
        self.engine = _FrontendEngine(self.tokenizer, self.vocab_size, info["eos_token_ids"], args)

    def _wait_ready(self) -> dict[str, Any]:
        while not self._out.poll(0.2):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} while starting")
        try:
            msg = self._out.recv()
        except EOFError as exc:
            self._proc.join(5.0)
            raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} while starting") \
                from exc
        if msg[0] == "failed":
            if msg[1]:  # bad engine arguments: a ValueError, as the in-thread engine raises
                raise ValueError(msg[2].removeprefix("ValueError: "))
            raise RuntimeError(f"building the engine failed (in the engine core process): {msg[2]}")
        return msg[1]

    # ----------------------------------------------------------------- health from shared memory
    @property
    def _heartbeat(self) -> float:  # type: ignore[override]
        return self._board[HEARTBEAT]

    @property
    def _step_started(self) -> Optional[float]:  # type: ignore[override]
        v = self._board[STEP_STARTED]
        return None if math.isnan(v) else v

    @property
    def _seconds_per_token(self) -> float:  # type: ignore[override]
        return self._board[SECONDS_PER_TOKEN]

    def _current_step_tokens(self) -> int:
        return int(self._board[STEP_TOKENS])

    @property
    def pid(self) -> Optional[int]:
        """The engine core process's id."""
        return self._proc.pid

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._read, name="tallyserve-core-reader", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0, reason: str = "the server shut down") -> None:
        """Stop the engine core: unfinished requests end with EngineDeadError. If it has not stopped
        within `timeout` (stuck in a step), it is killed and its requests are failed from here."""
        deadline = time.monotonic() + timeout
        self.engine.structured.manager.shutdown()  # validation compiles: cancelled, their workers killed
        self._inbox.put(("stop", reason))
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_process(max(deadline - time.monotonic(), _EXIT_GRACE_S))
        self._fail_all(reason)

    def _stop_process(self, wait: float) -> None:
        proc = self._proc
        proc.join(wait)
        if proc.is_alive():  # it ignores SIGTERM (the server drains first): kill it
            logger.error("the engine core process did not stop; killing it")
            proc.kill()
            proc.join(_KILL_AFTER_S)
        self._inbox.close()

    def _stop_at_exit(self) -> None:
        if self._proc.is_alive():
            self._inbox.put(("stop", "the server process exited"))
            self._stop_process(_KILL_AFTER_S)

    # ----------------------------------------------------------------- reader thread
    def _read(self) -> None:
        reason: Optional[str] = None
        try:
            while True:
                msg = self._out.recv()
                if msg[0] == "step":
                    self._on_step(*msg[1:])
                elif msg[0] == "dead":
                    reason = msg[1]
                    break
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # noqa: BLE001 - a reader that dies must still end every stream
            logger.exception("reading from the engine core process failed")
            reason = f"reading from the engine core process failed: {type(exc).__name__}: {exc}"
        if reason is None:
            self._proc.join(1.0)
            reason = f"the engine core process died (exit code {self._proc.exitcode})"
            logger.error("%s", reason)
        self._fail_all(reason)

    def _on_step(self, items: list[tuple], stats: Optional[dict], step_tokens: list[int], picked: list[str]) -> None:
        if picked or stats is not None:
            with self._lock:
                for rid in picked:
                    self._inbox_times.pop(rid, None)
                if stats is not None:
                    self._stats = stats
            if stats is not None and STRUCTURED_STATS_KEY in stats:
                self.engine.count_structured(*stats[STRUCTURED_STATS_KEY])
        if self.step_observer is not None:
            for tokens in step_tokens:
                self.step_observer(tokens)
        streams, decoded = self._streams, []
        for item in items:
            if item[0] == "o":
                rid = item[1][0]
                if rid not in streams:  # aborted here: nobody listens
                    self._decoder.forget(rid)
                    continue
                out = self._decoder.decode(item[1])
                if out is not None:
                    decoded.append((rid, out, out.finished))
            elif item[0] == "x":
                self._decoder.forget(item[1])
                decoded.append((item[1], _ERRORS.get(item[2], StepFailedError)(item[3]), True))
            else:  # "b": a finished beam search
                decoded.append((item[1], item[2], True))
        batch = []
        with self._lock:
            for rid, out, finished in decoded:
                stream = streams.pop(rid, None) if finished else streams.get(rid)
                if stream is not None:
                    batch.append((stream, out))
        self._deliver(batch, finished=False)
        if len(self._decoder) > len(streams) + 64:  # requests aborted after their last output
            for rid in self._decoder.request_ids():
                if rid not in streams:
                    self._decoder.forget(rid)


class _FrontendEngine:
    """What the server reads from `AsyncLLMEngine.engine` in-thread: the structured-output compile
    cache (grammars are compiled here to answer 400s, and again in the engine core process; its
    metrics merge both), and no KV connector or executor (disaggregated serving runs in-thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], args: Any) -> None:
        from tallyserve.structured_output.limits import StructuredOutputsLimits
        from tallyserve.structured_output.manager import StructuredOutputManager

        self.tokenizer = tokenizer
        self.structured = SimpleNamespace(manager=StructuredOutputManager(
            tokenizer, vocab_size, eos_token_ids, limits=StructuredOutputsLimits.from_args(args)))
        self.kv_connector = None
        self.executor = None

    def count_structured(self, requests: dict[str, int], cache_hits: int) -> None:
        """The engine core's request and cache-hit counts into the compile stats /metrics reads (this
        process's validation compiles count compiles, their time and failures, never requests or hits)."""
        stats = self.structured.manager.stats
        if stats is not None:
            stats.requests = dict(requests)
            stats.cache_hits = cache_hits


def _load_tokenizer(info: dict[str, Any], args: Any) -> Any:
    if info.get("tokenizer") is not None:
        try:
            return pickle.loads(info["tokenizer"])
        except Exception:  # noqa: BLE001 - load it from its files instead
            logger.warning("the engine's tokenizer did not unpickle; loading it from its files")
    from tallyserve.models.loader import resolve_model
    from tallyserve.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer or resolve_model(args.model, args.load_format).tokenizer_dir)
