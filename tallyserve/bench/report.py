"""The report of a run: one result dict, printed as a rich table, written as JSON, drawn as a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.console import Console
from rich.table import Table

from tallyserve.bench.metrics import LATENCY_METRICS, PERCENTILES, RequestRecord, latency_arrays, summarize, timeline

_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
           "e2el": "End-to-end latency"}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def build_result(tool: str, config: dict, records: Sequence[RequestRecord], duration_s: float,
                 extra: Optional[dict] = None) -> dict[str, Any]:
    """Flat vLLM-style metrics at the top, then config, timeline, extra sections, per-request rows."""
    result: dict[str, Any] = {"tool": tool}
    result.update(summarize(records, duration_s))
    result["config"] = _jsonable(config)
    result["timeline"] = timeline(records, duration_s)
    for key, value in (extra or {}).items():
        result[key] = _jsonable(value)
    result["requests"] = [r.as_dict() for r in records]
    return result


def write_json(result: dict, path: str) -> None:
    Path(path).write_text(json.dumps(result, indent=1))


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def print_report(result: dict, console: Optional[Console] = None, title: str = "Benchmark result") -> None:
    console = console or Console()
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("num_requests", "completed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "input_throughput", "output_throughput", "total_token_throughput"):
        table.add_row(key, _fmt(result.get(key)))
    for kind, n in result.get("error_kinds", {}).items():
        table.add_row(f"  errors: {kind}", _fmt(n))
    console.print(table)
    lat = Table(title="Latency (ms)", show_header=True, header_style="bold")
    lat.add_column("metric")
    for col in ["mean"] + [f"p{p}" for p in PERCENTILES]:
        lat.add_column(col, justify="right")
    for name in LATENCY_METRICS:
        lat.add_row(name.upper(), *(_fmt(result.get(f"{col}_{name}_ms")) for col in
                                    ["mean"] + [f"p{p}" for p in PERCENTILES]))
    console.print(lat)
    sim = result.get("simulator")
    if sim:
        st = Table(title="Simulator", show_header=True, header_style="bold")
        st.add_column("metric")
        st.add_column("value", justify="right")
        for key, value in _flatten(sim):
            st.add_row(key, _fmt(value, 4))
        console.print(st)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    rows = []
    for key, value in d.items():
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            rows.append((prefix + key, value))
    return rows


def plot(result: dict, records: Sequence[RequestRecord], path: str) -> None:
    """Latency histograms (TTFT, TPOT, ITL, E2EL) and throughput over time, as a PNG."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrays = latency_arrays(records)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, name in zip(axes.flat, LATENCY_METRICS):
        values = arrays[name] * 1000.0
        if values.size:
            shown = values[values <= np.percentile(values, 99.5)]  # a long tail would squash the plot
            ax.hist(shown, bins=min(50, max(5, shown.size // 4)), color="tab:blue", alpha=0.8)
            for p, style in zip(PERCENTILES, (":", "--", "-")):
                v = result.get(f"p{p}_{name}_ms")
                if v is not None:
                    ax.axvline(v, color="tab:red", linestyle=style, label=f"p{p} {v:.1f}")
            ax.legend(fontsize=8)
        ax.set_title(f"{_TITLES[name]} (ms, to p99.5)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    tl = result["timeline"]
    ax = axes.flat[4]
    ax.plot(tl["t_s"], tl["output_tokens_per_s"], color="tab:green")
    ax.set_title("Output throughput over time")
    ax.set_xlabel("s")
    ax.set_ylabel("tokens/s")
    ax = axes.flat[5]
    ax.plot(tl["t_s"], tl["requests_per_s"], color="tab:purple")
    ax.set_title("Completed requests over time")
    ax.set_xlabel("s")
    ax.set_ylabel("requests/s")
    fig.suptitle(f"{result.get('tool', '')}: {result['completed']}/{result['num_requests']} completed, "
                 f"{result['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
