"""Prometheus metrics, all named `tallyserve_*`, in a per-app CollectorRegistry.

Request-level metrics (finish reasons, latencies, tokens) are recorded by the server as requests
end. `tallyserve_requests_total{finish_reason}` counts each engine request that a completions,
chat or responses route starts exactly once, whatever its end: one per choice (one in all when
it ended before any output), "stop" / "length" when it finished, "error" when the engine failed,
"abort" when it was cut short: its client left (mid-stream, or before the response started), or
the engine refused it as queue full (a 429 as well). A client that leaves while its request body
is still being read counts as one "abort" (the request reached its route; no response is made).
A request refused before the engine (validation, admission: 4xx / 503) is not in it.
`tallyserve_http_errors_total{status}` counts the error responses the server answers with; a
client that left while its body was read gets none (not a 400). Every HTTP request runs in a
`request_scope` (entered by the app's outermost middleware): when the exchange ends, each of its
trackers that nothing finished (an engine stream never iterated, as when the client left before the
response started) is finished then, as an abort.

Engine-level ones (queue gauges, KV blocks, prefix hits, preemptions, ledger violations) are read
at scrape time from the stats snapshot the engine loop publishes after every step, so the event
loop never touches the engine itself."""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Iterable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tallyserve.engine.async_engine import AsyncLLMEngine
from tallyserve.outputs import RequestOutput
from tallyserve.structured_output.metrics import StructuredOutputCollector, engine_compile_stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# stats key -> (metric name without _total, help)
_ENGINE_COUNTERS = {
    "steps": ("tallyserve_engine_steps", "Engine steps that scheduled work."),
    "scheduled_tokens": ("tallyserve_scheduled_tokens", "Tokens the scheduler charged."),
    "forward_tokens": ("tallyserve_forward_tokens", "Tokens the forward pass computed."),
    "prefix_hit_tokens": ("tallyserve_prefix_hit_tokens", "Prompt tokens served from the prefix cache."),
    "partial_hit_tokens": ("tallyserve_partial_hit_tokens", "Prompt tokens served from partially matching blocks."),
    "preemptions": ("tallyserve_preemptions", "Requests preempted to free KV blocks."),
    "ledger_violations": ("tallyserve_ledger_violations", "Steps whose built batch disagreed with the scheduler's charge."),
    "step_errors": ("tallyserve_step_errors", "Engine steps that failed with an exception."),
    "host_hit_tokens": ("tallyserve_host_hit_tokens", "Prompt tokens restored from the host KV tier."),
    "host_blocks_offloaded": ("tallyserve_host_blocks_offloaded", "Evicted prefix blocks copied to the host tier."),
    "host_blocks_restored": ("tallyserve_host_blocks_restored", "Host-tier blocks copied back to the device."),
    "kv_bytes_moved": ("tallyserve_kv_transfer_bytes", "Bytes moved between the device and host KV pools."),
    "spec_proposed": ("tallyserve_spec_decode_draft_tokens", "Draft tokens proposed for verification."),
    "spec_accepted": ("tallyserve_spec_decode_accepted_tokens", "Draft tokens accepted by verification."),
    # disaggregated serving (a kv_consumer loads, a kv_producer holds)
    "kv_loads_finished": ("tallyserve_kv_connector_loads", "Remote KV loads that finished."),
    "kv_load_failures": ("tallyserve_kv_connector_load_failures", "Remote KV loads that failed or timed out."),
    "kv_unknown_engine": ("tallyserve_kv_connector_unknown_engine", "Loads failed because the producer was unknown."),
    "kv_loads_expired": ("tallyserve_kv_connector_loads_expired",
                         "Remote prompts computed locally: too close to the producer's hold deadline."),
    "kv_bytes_received": ("tallyserve_kv_connector_received_bytes", "KV bytes received from producers."),
    "kv_load_seconds": ("tallyserve_kv_connector_load_seconds", "Seconds remote KV loads took, summed."),
    "kv_sends_finished": ("tallyserve_kv_connector_sends", "Held requests whose KV a consumer pulled."),
    "kv_holds_expired": ("tallyserve_kv_connector_holds_expired", "Held requests freed by the hold timeout."),
}


class EngineStatsCollector(Collector):
    """Engine gauges and counters from the loop's latest stats snapshot."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats()
        total, free = int(s.get("num_total_blocks", 0)), int(s.get("num_free_blocks", 0))
        gauges = [
            ("tallyserve_num_requests_running", "Sequences running in the engine.", s.get("num_running", 0)),
            ("tallyserve_num_requests_waiting", "Sequences waiting in the scheduler.", s.get("num_waiting", 0)),
            ("tallyserve_kv_blocks_total", "KV cache blocks in the pool.", total),
            ("tallyserve_kv_blocks_free", "KV cache blocks free (unreferenced, cached ones included).", free),
            ("tallyserve_kv_blocks_in_use", "KV cache blocks referenced by requests.", total - free),
            ("tallyserve_kv_blocks_cached", "KV cache blocks holding reusable prefix content.", s.get("num_cached_blocks", 0)),
            ("tallyserve_host_kv_blocks_total", "Blocks of the host KV tier (0: no tier).", s.get("num_host_blocks", 0)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        info = GaugeMetricFamily("tallyserve_cache_config_info", "The KV cache and weight formats, in the labels "
                                 "(value 1): the cache's dtype, its blocks, and the projections' quantization.",
                                 labels=["cache_dtype", "num_gpu_blocks", "num_host_blocks", "quantization"])
        info.add_metric([str(s.get("kv_cache_dtype", "")), str(total), str(s.get("num_host_blocks", 0)),
                         str(s.get("quantization") or "none")], 1.0)
        yield info
        health = self.engine.health()
        yield GaugeMetricFamily("tallyserve_engine_alive", "1 while the engine loop thread runs.", value=float(health.alive))
        yield GaugeMetricFamily("tallyserve_engine_healthy", "1 while /health answers 200.", value=float(health.healthy))
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(s.get(key, 0)))


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tallyserve_requests", "Engine requests started by the completions, chat and "
                                "responses routes, once each whatever their end (one per choice), by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self.http_errors = Counter("tallyserve_http_errors", "Error responses by HTTP status.", ["status"], registry=r)
        self.slow_client_aborts = Counter("tallyserve_slow_client_aborts",
                                          "Streams aborted because their client stopped reading "
                                          "(a send blocked longer than the slow client timeout).", registry=r)
        self.prompt_tokens = Counter("tallyserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("tallyserve_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("tallyserve_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tallyserve_time_per_output_token_seconds", "Mean time between output tokens.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tallyserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_per_step = Histogram("tallyserve_tokens_per_step", "Tokens scheduled in each engine step.",
                                         buckets=_TOKEN_BUCKETS, registry=r)
        r.register(EngineStatsCollector(engine))
        r.register(StructuredOutputCollector(engine_compile_stats(engine)))
        engine.step_observer = self.tokens_per_step.observe

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        """A tracker of one engine request, counted from now on: finished by its stream, or at the
        end of the request scope it was made in."""
        tracker = RequestTracker(self)
        scope = _OPEN_TRACKERS.get()
        if scope is not None:
            scope.append(tracker)
        return tracker

    def client_left_before_body(self) -> None:
        """A completions / chat / responses request whose client left before its body was read:
        one abort (its n is unknown), no error response."""
        self.requests.labels(finish_reason="abort").inc()


# The trackers made while serving one HTTP request (request_scope), shared by the tasks it starts.
_OPEN_TRACKERS: ContextVar[Optional[list["RequestTracker"]]] = ContextVar("tallyserve_open_trackers", default=None)


@contextlib.contextmanager
def request_scope() -> Iterator[None]:
    """Around one HTTP request: on exit, every tracker made inside that is still open is finished
    (RequestTracker.close), so each engine request is counted exactly once, however it ended."""
    token = _OPEN_TRACKERS.set([])
    try:
        yield
    finally:
        trackers = _OPEN_TRACKERS.get() or []
        _OPEN_TRACKERS.reset(token)
        for tracker in trackers:
            tracker.close()


class RequestTracker:
    """Times one engine request (all its n choices) and records it once when it ends."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token: Optional[float] = None
        self.last: Optional[RequestOutput] = None
        self.done = False

    def observe(self, out: RequestOutput, timed: bool = True) -> None:
        """Record the latest output; `timed=False` for results that arrive all at once (beam
        search), which have no time to first token or per output token."""
        self.last = out
        if timed and self.first_token is None and any(o.token_ids for o in out.outputs):
            self.first_token = time.monotonic()

    def discard(self) -> None:
        """Never count this request (it never ran: the client got an error response instead)."""
        self.done = True

    def close(self) -> None:
        """Finish the request as its last output says, or as an abort if it did not finish."""
        self.finish(None if self.last is not None and self.last.finished else "abort")

    def finish(self, override_reason: Optional[str] = None) -> None:
        """Record the request; override_reason ("abort", "error") for requests that did not end
        normally. Safe to call more than once."""
        if self.done:
            return
        self.done = True
        m, end, out = self.metrics, time.monotonic(), self.last
        outputs = out.outputs if out is not None else []
        for o in outputs or [None]:
            reason = override_reason or (o.finish_reason if o is not None else None) or "abort"
            m.requests.labels(finish_reason=reason).inc()
        if out is not None:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        generated = [len(o.token_ids) for o in outputs]
        m.generation_tokens.inc(sum(generated))
        if override_reason is not None:
            return  # latencies describe completed requests only
        m.e2e.observe(end - self.start)
        if self.first_token is not None:
            m.ttft.observe(self.first_token - self.start)
            longest = max(generated, default=0)
            if longest > 1:
                m.tpot.observe((end - self.first_token) / (longest - 1))
