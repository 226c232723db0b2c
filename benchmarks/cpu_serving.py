"""The servers and the serving mode of the CPU side by side (``benchmarks/cpu.py compare``).

Servers: llama.cpp's llama-server and `tallyserve serve`, each a child process on a free local port, its log in the
cache's ``logs/``; ``ServerProcess`` waits for its health route and stops it (SIGTERM, then SIGKILL) on exit.
``run_llama_offline`` is W as one burst on llama-server: all prompts sent at once as token ids to its native
``/completion`` route, timed from the first send to the last answer.

Serving mode: W's prompts through an OpenAI-compatible server, 1 and 16 streams. Each stream sends W's prompts one
after another (a stream takes the next unsent prompt when its previous answer ends) to ``/v1/completions`` as token
ids, streaming, greedy, 64 new tokens, EOS ignored. Per request: TTFT (send to first token) and ms per output token
after the first (TPOT); per run: mean and median of both, wall time and output tokens per second. The client is
tallyserve's benchmark client (``tallyserve.bench.client``), the same for both servers.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx

from tallyserve.bench.client import first_model_id, send_request
from tallyserve.bench.metrics import RequestRecord


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server child process; ``with ServerProcess(...) as srv:`` waits until ``srv.url + health`` answers 200."""

    def __init__(self, cmd: Sequence[str], port: int, log: Path, health: str = "/health",
                 env: Optional[dict] = None, start_timeout_s: float = 600.0):
        self.cmd, self.port, self.log, self.health = list(cmd), port, log, health
        self.env, self.start_timeout_s = env, start_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.start_s: Optional[float] = None

    def __enter__(self) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env)
        fh.close()
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        while time.perf_counter() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode} while starting:\n{tail}")
            try:
                if httpx.get(self.url + self.health, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.cmd[0]} did not answer {self.health} within {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def llama_server_cmd(server: Path, gguf: Path, port: int, threads: int, num_slots: int, slot_ctx: int) -> list[str]:
    """llama-server with one KV region per slot (``--no-kv-unified``), prompt caching off, no web UI."""
    return [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(num_slots), "-c", str(num_slots * slot_ctx), "--no-kv-unified",
            "-t", str(threads), "--no-cache-prompt", "--no-webui"]


def tallyserve_cmd(python: str, port: int, dtype: str = "auto") -> list[str]:
    """`tallyserve serve` on the bundled model; prefix caching off so repeated prompts across runs compute again."""
    return [python, "-m", "tallyserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--no-enable-prefix-caching", "--disable-access-log", "--log-level", "warning"]


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


async def _completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "return_tokens": True}
    resp = await client.post(url + "/completion", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"llama-server answered {resp.status_code}: {resp.text[:500]}")
    data = resp.json()
    return list(data.get("tokens") or [])


async def _burst(url: str, prompts: Sequence[list[int]], max_tokens: int,
                 timeout_s: float = 3600.0) -> tuple[float, list[list[int]]]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t = time.perf_counter()
        outs = await asyncio.gather(*[_completion(client, url, p, max_tokens) for p in prompts])
        return time.perf_counter() - t, list(outs)


def llama_server_version(server: Path) -> Optional[str]:
    """`llama-server --version` in one line, e.g. "version: 0.5.0-dev (build 1, commit 0c1e570)"."""
    try:
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None


def warmup_prompts() -> list[list[int]]:
    """Two 32-token prompts of ids W never draws (as in cpu_engine_worker.py)."""
    return [[40000 + (37 * j + k) % 9000 for k in range(32)] for j in range(2)]


def run_llama_offline(server: Path, gguf: Path, prompts: Sequence[list[int]], max_tokens: int, threads: int,
                      log: Path, timeout_s: float = 3600.0) -> dict:
    """W on llama-server: one slot per prompt, every prompt sent at once; returns the worker-shaped result."""
    slot_ctx = -(-(max(len(p) for p in prompts) + max_tokens + 64) // 256) * 256
    port = free_port()
    cmd = llama_server_cmd(server, gguf, port, threads, len(prompts), slot_ctx)
    with ServerProcess(cmd, port, log) as srv:
        asyncio.run(_burst(srv.url, warmup_prompts(), 4))
        elapsed, outputs = asyncio.run(_burst(srv.url, prompts, max_tokens, timeout_s))
        load_s = srv.start_s
    return {"engine": "llama.cpp", "time_s": elapsed, "load_s": load_s, "outputs": outputs,
            "version": llama_server_version(server),
            "threads": threads, "output_tokens": sum(len(o) for o in outputs),
            "settings": {"model": gguf.name, "slots": len(prompts), "ctx_per_slot": slot_ctx, "kv_unified": False,
                         "cache_prompt": False, "cmd": " ".join(cmd[1:])}}


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
