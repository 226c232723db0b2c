"""`tallyserve serve`: the OpenAI-compatible server on uvicorn, with a SIGTERM drain that exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from typing import Iterator

import uvicorn

from tallyserve.cli import add_engine_args, engine_args_from

logger = logging.getLogger("tallyserve.server")
DEFAULT_DRAIN_TIMEOUT_S = 30.0
GRACE_AFTER_DRAIN_S = 5.0  # for connections to flush their last bytes once the engine has stopped


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model (the bundled SmolLM2-135M-Instruct without --model) "
                                          "over an OpenAI-compatible HTTP API.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="answer 429 while this many requests wait (default: unlimited)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--stall-timeout", type=float, default=5.0,
                   help="/health fails when no step completes for this many seconds while work is pending")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="expose POST /debug/fault (tests only)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--disable-access-log", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=serve)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM / SIGINT drain and the process then exits 0 (uvicorn's own
    handler re-raises the signal after shutting down, which ends the process with -15).

    Drain: stop listening at once; new requests on open connections get 503; in-flight requests
    get up to `drain_timeout` seconds; whatever is left then ends with an error response (503,
    or an error event in a stream) before uvicorn closes the connections."""

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.health().pending and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        left = self.engine.health().pending
        if left:
            logger.warning("drain timeout (%ss): ending %d unfinished request(s)", self.drain_timeout, left)
        await asyncio.to_thread(self.engine.shutdown, 2.0, "the server shut down before the request finished")
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, _frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: stop waiting
            return
        logger.warning("received %s: draining (no new requests, in-flight ones get up to %ss)",
                       signal.Signals(sig).name, self.drain_timeout)
        self.engine.draining = True
        self.should_exit = True


def _validate(ns: argparse.Namespace) -> None:
    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    if not ns.stall_timeout > 0:
        raise ValueError(f"--stall-timeout must be > 0, got {ns.stall_timeout}")
    if not ns.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {ns.drain_timeout}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")


def serve(ns: argparse.Namespace) -> int:
    _validate(ns)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tallyserve.engine.async_engine import AsyncLLMEngine
    from tallyserve.engine.llm_engine import LLMEngine
    from tallyserve.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine(engine_args_from(ns)), stall_timeout=ns.stall_timeout,
                            max_queue_len=ns.max_queue_len)
    app = build_app(engine, api_key=ns.api_key, enable_fault_injection=ns.enable_fault_injection)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            access_log=not ns.disable_access_log, timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,
                            lifespan="on")
    logger.info("serving %s at http://%s:%d/v1", engine.served_model_name, ns.host, ns.port)
    DrainingServer(config, engine, ns.drain_timeout).run()
    return 0
