"""`tallyserve serve`: the OpenAI-compatible server on uvicorn, with a SIGTERM drain that exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
import signal
import time
from typing import Iterator, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tallyserve.config.args import add_engine_args, engine_args_from
from tallyserve.server.tool_parsers import tool_parser_names

logger = logging.getLogger("tallyserve.server")
DEFAULT_DRAIN_TIMEOUT_S = 30.0
GRACE_AFTER_DRAIN_S = 5.0  # for connections to flush their last bytes once the engine has stopped
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


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
    p.add_argument("--slow-client-timeout", type=float, default=60.0,
                   help="abort a stream (freeing its KV blocks) and close its connection when the client "
                        "has not read for this many seconds (a send stays blocked by flow control)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="expose POST /debug/fault (tests only)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="answer 413 to a request body larger than this, before reading it (default: "
                        "4 MiB + 64 bytes per token of max_model_len)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="close a connection whose request headers are not complete this many seconds after it "
                        f"opened or sent its first byte, so half-open connections never pile up (default: "
                        f"{DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="answer 408 and close the connection when a request's body has not fully arrived this many "
                        f"seconds after its headers (default: {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in a request (off: such a request is a 400; a template "
                        "can run for as long as it likes on the tokenizer thread)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): read tool calls in the output with '
                        "--tool-call-parser (without this flag such requests are 400s)")
    p.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="the format of the model's tool calls (hermes for Hermes/Qwen/ChatML models, "
                        "llama3_json, mistral)")
    p.add_argument("--disable-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (with --api-key they need the key)")
    mp = p.add_mutually_exclusive_group()
    mp.add_argument("--enable-frontend-multiprocessing", dest="frontend_multiprocessing", action="store_true",
                    default=None,
                    help="run the engine's step loop in its own process (the engine core process), so that HTTP "
                         "and streaming work in the server process does not take time from the steps (the "
                         "default, except with --kv-transfer-config)")
    mp.add_argument("--disable-frontend-multiprocessing", dest="frontend_multiprocessing", action="store_false",
                    default=None, help="run the engine's step loop in a thread of the server process")
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
    if not ns.slow_client_timeout > 0:
        raise ValueError(f"--slow-client-timeout must be > 0, got {ns.slow_client_timeout}")
    if not ns.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {ns.drain_timeout}")
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    if ns.max_request_body_bytes is not None and ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {ns.max_request_body_bytes}")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if not ns.header_timeout > 0:
        raise ValueError(f"--header-timeout must be > 0, got {ns.header_timeout}")
    if not ns.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0, got {ns.body_timeout}")


class RequestTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on request headers and bodies, which uvicorn lacks.

    Headers: a connection that has not sent complete headers `header_timeout` seconds after it
    opened (or, between keep-alive requests, after the next request's first byte) is closed, with
    a 408 if it sent anything. Body: a request whose body is not complete `body_timeout` seconds
    after its headers is answered 408 (when no response has started) and its connection closed.
    Neither deadline is extended by trickled bytes, so slow clients cannot hold file descriptors
    for long. Idle keep-alive connections stay under uvicorn's own keep-alive timeout. See
    `request_timeout_protocol`."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    _header_timer: Optional[asyncio.TimerHandle] = None
    _body_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # the request's headers are still incomplete
            self._arm_header_timer()
            return
        self._header_timer = _cancel(self._header_timer)
        if state is h11.SEND_BODY:
            if self._body_timer is None and not self.transport.is_closing():
                self._body_timer = self.loop.call_later(self.body_timeout, self._on_body_timeout)
        else:  # the body is complete (DONE), or the connection is past the request
            self._body_timer = _cancel(self._body_timer)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._header_timer = _cancel(self._header_timer)
        self._body_timer = _cancel(self._body_timer)
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # it sent part of a request: say why it is closed
            self.transport.write(_REQUEST_TIMEOUT)
        self.logger.debug("closing a connection that sent no complete request headers in %ss", self.header_timeout)
        self.transport.close()

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        cycle = getattr(self, "cycle", None)
        if cycle is None or not cycle.response_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.logger.debug("closing a connection whose request body did not arrive in %ss", self.body_timeout)
        self.transport.close()  # the app's receive() then reports the client gone


_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _cancel(timer: Optional[asyncio.TimerHandle]) -> None:
    if timer is not None:
        timer.cancel()
    return None


def request_timeout_protocol(header_timeout: float, body_timeout: float = DEFAULT_BODY_TIMEOUT_S
                             ) -> type[RequestTimeoutProtocol]:
    """The protocol class to pass as uvicorn's `http=`, with these deadlines."""
    return type("RequestTimeoutProtocol", (RequestTimeoutProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


def raise_open_file_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as vLLM does): each connection is a file
    descriptor, and at the limit accept() fails, so no new connection (not even /health) gets in."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("could not raise the open-file limit (RLIMIT_NOFILE) from %d to %d: %s", soft, target, exc)
        return
    logger.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d", soft, target)


def serve_worker_node(ns: argparse.Namespace) -> int:
    """`--node-rank R > 0`: run this node's tensor-parallel workers only (node 0 runs the scheduler
    and the server); return when they exit (node 0 shut down) or on SIGTERM / Ctrl-C."""
    from tallyserve.executor.multiproc import init_method, spawn_workers
    from tallyserve.executor.resolve import resolve_engine

    resolved, _ = resolve_engine(engine_args_from(ns), load_tokenizer=False)  # only rank 0 (on node 0) samples
    args = resolved.args
    procs, _ = spawn_workers(resolved, init_method(args))
    logger.info("node %d: running tensor-parallel ranks %s for %s", args.node_rank,
                [p.name for p in procs], args.dist_init_addr)

    def stop(sig: int, _frame) -> None:
        for p in procs:
            if p.is_alive():
                p.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    for p in procs:
        p.join()
    bad = [p for p in procs if p.exitcode not in (0, -signal.SIGTERM)]
    for p in bad:
        logger.error("worker %s exited with code %s", p.name, p.exitcode)
    return 1 if bad else 0


def build_engine(ns: argparse.Namespace):
    """The server's AsyncLLMEngine: the step loop in the engine core process (MPClient: frontend
    multiprocessing, the default), or on a thread of this process (InprocClient:
    --disable-frontend-multiprocessing, and disaggregated serving, whose KV connector the server uses)."""
    args = engine_args_from(ns)
    limits = dict(stall_timeout=ns.stall_timeout, max_queue_len=ns.max_queue_len,
                  slow_client_timeout=ns.slow_client_timeout)
    in_process = getattr(ns, "frontend_multiprocessing", None)
    if args.kv_transfer_config is not None:  # disaggregated serving: its connector lives with the server
        if in_process:
            raise ValueError("--kv-transfer-config (disaggregated serving) needs the in-thread engine: "
                             "drop --enable-frontend-multiprocessing")
        in_process = False
    from tallyserve.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(args, frontend_multiprocessing=in_process is None or in_process, **limits)


def serve(ns: argparse.Namespace) -> int:
    _validate(ns)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (ns.node_rank or 0) > 0:
        return serve_worker_node(ns)
    raise_open_file_limit()
    from tallyserve.server.app import build_app

    engine = build_engine(ns)
    if engine.kv_connector is not None:  # the address consumers pull this instance's KV from
        engine.kv_connector.advertise(ns.host, ns.port)
    app = build_app(engine, api_key=ns.api_key, enable_fault_injection=ns.enable_fault_injection,
                    max_request_body_bytes=ns.max_request_body_bytes, enable_docs=not ns.disable_docs,
                    trust_request_chat_template=ns.trust_request_chat_template,
                    enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                            http=request_timeout_protocol(ns.header_timeout, ns.body_timeout),
                            access_log=not ns.disable_access_log, timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,
                            lifespan="on")
    logger.info("serving %s at http://%s:%d/v1", engine.served_model_name, ns.host, ns.port)
    DrainingServer(config, engine, ns.drain_timeout).run()
    return 0
