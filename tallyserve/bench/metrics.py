"""Per-request records and the summary both `bench` and `simulate` report.

Names follow vLLM's benchmark JSON (`request_throughput`, `mean_ttft_ms`, ...), with p50, p90
and p99 for TTFT, TPOT (time per output token after the first), ITL (gap between streamed
chunks) and E2EL (end-to-end latency).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: str
    conversation_id: Optional[str] = None
    turn: int = 0
    start_s: float = 0.0  # sent, seconds after the run started
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None  # end to end
    chunk_times_s: Sequence[float] = field(default_factory=list)  # each content chunk, run clock
    prompt_tokens: Optional[int] = None  # from the server's usage
    completion_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    error_kind: Optional[str] = None
    error: Optional[str] = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def tpot_s(self) -> Optional[float]:
        n = self.completion_tokens
        if not self.ok or n is None or n < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "start_s": _round(self.start_s),
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "latency_s": _round(self.latency_s),
            "num_chunks": len(self.chunk_times_s),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "error_kind": self.error_kind,
            "error": self.error,
        }


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(float(x), 6)


def itl_values(records: Sequence[RequestRecord]) -> np.ndarray:
    parts = [np.diff(np.asarray(r.chunk_times_s, dtype=np.float64)) for r in records
             if r.ok and len(r.chunk_times_s) > 1]
    return np.concatenate(parts) if parts else np.zeros(0)


def _stats(name: str, values_s: np.ndarray) -> dict[str, Optional[float]]:
    out: dict[str, Optional[float]] = {}
    if values_s.size == 0:
        out[f"mean_{name}_ms"] = None
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = None
        return out
    ms = values_s * 1000.0
    out[f"mean_{name}_ms"] = round(float(ms.mean()), 4)
    for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES)):
        out[f"p{p}_{name}_ms"] = round(float(v), 4)
    return out


def latency_arrays(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    ok = [r for r in records if r.ok]
    return {
        "ttft": np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=np.float64),
        "tpot": np.array([t for t in (r.tpot_s for r in ok) if t is not None], dtype=np.float64),
        "itl": itl_values(ok),
        "e2el": np.array([r.latency_s for r in ok if r.latency_s is not None], dtype=np.float64),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, token totals from usage, throughputs and latency statistics."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.completion_tokens or 0 for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_kinds": dict(sorted(errors.items())),
        "requests_without_usage": sum(1 for r in ok if r.completion_tokens is None),
        "duration_s": round(duration_s, 6),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    for name, values in latency_arrays(records).items():
        out.update(_stats(name, values))
    return out


def timeline(records: Sequence[RequestRecord], duration_s: float, num_bins: Optional[int] = None) -> dict[str, Any]:
    """Output tokens/s and completed requests/s over the run, in equal bins (10 to 60 of them,
    about one a second). A chunk counts completion_tokens / chunks (usage gives only totals)."""
    if num_bins is None:
        num_bins = int(min(60, max(10, duration_s)))
    width = max(duration_s, 1e-6) / num_bins
    tokens = np.zeros(num_bins)
    done = np.zeros(num_bins)
    for r in records:
        if not r.ok:
            continue
        times = np.asarray(r.chunk_times_s, dtype=np.float64)
        if times.size:
            per_chunk = (r.completion_tokens or times.size) / times.size
            idx = np.minimum((times / width).astype(np.int64), num_bins - 1)
            np.add.at(tokens, np.maximum(idx, 0), per_chunk)
        if r.latency_s is not None:
            done[min(max(int((r.start_s + r.latency_s) / width), 0), num_bins - 1)] += 1
    return {
        "bin_s": round(width, 6),
        "t_s": [round(width * (i + 0.5), 6) for i in range(num_bins)],
        "output_tokens_per_s": [round(float(x) / width, 3) for x in tokens],
        "requests_per_s": [round(float(x) / width, 3) for x in done],
    }
