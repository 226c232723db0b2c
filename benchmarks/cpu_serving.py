"""Serving mode of the CPU side-by-side: W's prompts through an OpenAI-compatible server, 1 and 16 streams.

Each stream sends W's prompts one after another (a stream takes the next unsent prompt when its previous answer
ends) to ``/v1/completions`` as token ids, streaming, greedy, 64 new tokens, EOS ignored. Per request: TTFT (send to
first token) and ms per output token after the first (TPOT); per run: mean and median of both, wall time and
output tokens per second. The client is tallyserve's benchmark client (``tallyserve.bench.client``), the same
for both servers.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Optional, Sequence

import httpx

from tallyserve.bench.client import first_model_id, send_request
from tallyserve.bench.metrics import RequestRecord


def payload(model: str, prompt: list[int], max_tokens: int, extra: Optional[dict] = None) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    return body


async def run_streams(base_url: str, prompts: Sequence[list[int]], num_streams: int, max_tokens: int,
                      extra: Optional[dict] = None) -> tuple[float, list[RequestRecord]]:
    """Send every prompt through ``num_streams`` concurrent streams; returns (wall seconds, records in prompt order)."""
    if num_streams < 1:
        raise ValueError(f"num_streams must be >= 1, got {num_streams}")
    root = base_url.rstrip("/") + "/v1"
    records: list[Optional[RequestRecord]] = [None] * len(prompts)
    next_index = 0
    limits = httpx.Limits(max_connections=num_streams + 2, max_keepalive_connections=num_streams + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        model = await first_model_id(client, root)
        t0 = time.perf_counter()

        async def stream() -> None:
            nonlocal next_index
            while next_index < len(prompts):
                i = next_index
                next_index += 1
                rec = RequestRecord(request_id=f"w-{i}")
                records[i] = await send_request(client, root, payload(model, prompts[i], max_tokens, extra), rec, t0)

        await asyncio.gather(*[stream() for _ in range(min(num_streams, len(prompts)))])
        wall = time.perf_counter() - t0
    return wall, [r for r in records if r is not None]


def _ms(values: list[float], fn) -> Optional[float]:
    return round(fn(values) * 1000, 2) if values else None


def summarize_streams(wall_s: float, records: Sequence[RequestRecord], num_streams: int) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = []
    for r in ok:
        n = r.completion_tokens if r.completion_tokens is not None else len(r.chunk_times_s)
        if n >= 2 and r.ttft_s is not None and r.latency_s is not None:
            tpot.append((r.latency_s - r.ttft_s) / (n - 1))
    out_tokens = sum((r.completion_tokens if r.completion_tokens is not None else len(r.chunk_times_s)) for r in ok)
    errors = [f"{r.request_id}: {r.error_kind}: {(r.error or '')[:200]}" for r in records if not r.ok]
    return {"streams": num_streams, "requests": len(records), "ok": len(ok), "wall_s": round(wall_s, 3),
            "output_tokens": out_tokens, "output_tok_per_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
            "mean_ttft_ms": _ms(ttft, statistics.fmean), "median_ttft_ms": _ms(ttft, statistics.median),
            "mean_tpot_ms": _ms(tpot, statistics.fmean), "median_tpot_ms": _ms(tpot, statistics.median),
            "errors": errors[:5]}


def serve_and_measure(base_url: str, prompts: Sequence[list[int]], stream_counts: Sequence[int], max_tokens: int,
                      extra: Optional[dict] = None) -> list[dict[str, Any]]:
    """Warm the server with two short requests, then one run per stream count, in order."""
    warm = [[40000 + (37 * j + k) % 9000 for k in range(32)] for j in range(2)]
    _, records = asyncio.run(run_streams(base_url, warm, 2, 4, extra))
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"the warm-up request failed: {failed[0].error_kind}: {(failed[0].error or '')[:300]}")
    rows = []
    for n in stream_counts:
        wall, records = asyncio.run(run_streams(base_url, prompts, n, max_tokens, extra))
        rows.append(summarize_streams(wall, records, n))
    return rows
