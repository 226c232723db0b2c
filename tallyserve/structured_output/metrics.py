"""Prometheus metrics of structured outputs, read at scrape time from the compile cache's counters:
tallyserve_structured_output_requests_total{kind}, tallyserve_structured_output_compile_seconds
(a histogram of grammar compiles), tallyserve_structured_output_cache_hits_total and
tallyserve_structured_output_compile_failures_total, the compile pool's
tallyserve_structured_output_compile_queue_depth and _compiles_running, and the counts of
compiles that timed out, were cancelled (their clients left) or were refused by a limit."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tallyserve.sampling_params import StructuredOutputsParams
from tallyserve.structured_output.compile_pool import pool_gauges
from tallyserve.structured_output.compiler import COMPILE_BUCKETS, CompileStats


class StructuredOutputCollector(Collector):
    def __init__(self, stats: Callable[[], Optional[CompileStats]]) -> None:
        self._stats = stats  # None until the first structured-output request built the cache

    def collect(self) -> Iterable[Metric]:
        s = self._stats() or CompileStats()
        requests = CounterMetricFamily("tallyserve_structured_output_requests",
                                       "Requests with structured outputs, by kind of constraint.", labels=["kind"])
        for kind in StructuredOutputsParams.KINDS:
            requests.add_metric([kind], float(s.requests.get(kind, 0)))
        yield requests
        yield CounterMetricFamily("tallyserve_structured_output_cache_hits",
                                  "Structured-output requests whose grammar was already compiled (or compiling).",
                                  value=float(s.cache_hits))
        yield CounterMetricFamily("tallyserve_structured_output_compile_failures",
                                  "Constraints that did not compile (bad schema, regex or grammar).",
                                  value=float(s.failures))
        for name, doc, value in (
                ("compile_timeouts", "Compiles that passed --structured-outputs-compile-timeout (a 400).", s.timeouts),
                ("compile_cancelled", "Compiles stopped because no request waited for them any more.", s.cancelled),
                ("limit_rejections", "Constraints refused before compiling: over a limit, or a keyword the "
                                     "backend cannot enforce.", s.rejected)):
            yield CounterMetricFamily(f"tallyserve_structured_output_{name}", doc, value=float(value))
        queued, running = pool_gauges()
        yield GaugeMetricFamily("tallyserve_structured_output_compile_queue_depth",
                                "Grammar compiles waiting for a worker process.", value=float(queued))
        yield GaugeMetricFamily("tallyserve_structured_output_compiles_running",
                                "Grammar compiles running in worker processes.", value=float(running))
        cumulative, buckets = 0, []
        for bound, count in zip(COMPILE_BUCKETS, list(s.compile_bucket_counts)):
            cumulative += count
            buckets.append((repr(float(bound)), float(cumulative)))
        buckets.append(("+Inf", float(s.compiles)))
        yield HistogramMetricFamily("tallyserve_structured_output_compile_seconds",
                                    "Seconds to compile a grammar (compiles run off the step loop).",
                                    buckets=buckets, sum_value=s.compile_seconds_sum)


def engine_compile_stats(async_engine: Any) -> Callable[[], Optional[CompileStats]]:
    """The stats getter for an AsyncLLMEngine (None where the engine has no structured outputs)."""
    def get() -> Optional[CompileStats]:
        manager = getattr(async_engine, "structured", None)
        return manager.stats if manager is not None else None
    return get
