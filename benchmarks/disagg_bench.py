"""Disaggregated prefill/decode figures.

1. ``transfer``: KV transfer bandwidth of the NixlConnector's own path. Two processes each build a
   NixlConnectorWorker over KV caches of a model's shape; the consumer READs N blocks from the
   producer as a real load and reports GB/s per size, for blocks consecutive on both sides (one
   descriptor per layer and K/V half) and scattered ones (one per layer, K/V half and block).
2. ``proxy``: per-request overhead of the proxy path. A kv_producer, a kv_consumer and `tallyserve
   proxy`, plus one colocated instance, as separate processes; the same greedy requests go to the
   colocated instance and through the proxy, one at a time; the report gives latency p50/p99 of
   each and the difference.

CPU (the bundled model):       python benchmarks/disagg_bench.py
One H200, two processes sharing the card:
    python benchmarks/disagg_bench.py --device cuda --model llama-3-8b --load-format dummy \\
        --gpu-memory-utilization 0.45 --prompt-len 1024 --max-tokens 128 --requests 64 --request-rate 4
(the colocated instance then runs after the pair, with the same memory share, not beside it;
--request-rate adds TTFT / ITL p50/p99 at a fixed Poisson rate through `tallyserve bench`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python benchmarks/disagg_bench.py`: its workers import tallyserve too
    sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- transfer
def _worker(role: str, conn, shape, dtype_name: str, device: str, engine_id: str) -> None:
    import torch

    from tallyserve.core.sched_output import RemoteKVLoad
    from tallyserve.distributed.kv_transfer.base import KVConnectorMetadata
    from tallyserve.distributed.kv_transfer.config import KVTransferConfig
    from tallyserve.distributed.kv_transfer.nixl_connector import NixlConnectorWorker

    layers, blocks, block_size, heads, head_dim = shape
    dtype = getattr(torch, dtype_name)
    caches = [torch.full((2, blocks, block_size, heads, head_dim), float(i + 1 if role == "p" else 0), dtype=dtype,
                         device=device) for i in range(layers)]
    cfg = KVTransferConfig(kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=engine_id)
    w = NixlConnectorWorker(cfg, block_size)
    w.register_kv_caches(caches)
    conn.send(w.metadata())
    if role == "p":
        conn.recv()  # until the consumer is done
        return
    w.add_remote(conn.recv())
    results = []
    import random

    for n, pattern in [(n, p) for n in conn.recv() for p in ("contiguous", "scattered")]:
        ids = tuple(range(n))
        # scattered: the producer's blocks in a random order, so no two neighbours stay neighbours (one
        # descriptor per block and layer half); contiguous: one descriptor per layer half
        far = ids if pattern == "contiguous" else tuple(random.Random(n).sample(ids, n))
        best = float("inf")
        for rep in range(3):
            load = RemoteKVLoad(f"r{n}-{pattern}-{rep}", ids, far, 0, n * block_size,
                                {"remote_engine_id": "bench-p", "remote_request_id": f"r{n}-{pattern}-{rep}",
                                 "remote_host": "127.0.0.1", "remote_port": 1})
            t0 = time.perf_counter()
            w.start_load_kv(KVConnectorMetadata(loads=(load,)))
            while True:
                out = w.get_finished()
                if out.finished_recving or out.failed_recving:
                    break
            best = min(best, time.perf_counter() - t0)
            assert not out.failed_recving, out.failed_recving
        nbytes = 2 * layers * n * caches[0][0, 0].numel() * caches[0].element_size()
        ok = bool((caches[-1][:, :n] == layers).all())
        results.append({"blocks": n, "pattern": pattern, "bytes": nbytes, "seconds": best, "GB_per_s": nbytes / best / 1e9, "ok": ok})
    conn.send(results)


def bench_transfer(ns) -> list[dict]:
    from tallyserve.models.loader import resolve_model

    mc = resolve_model(ns.model, ns.load_format).model_config
    shape = (mc.num_hidden_layers, max(ns.transfer_blocks), ns.block_size, mc.num_key_value_heads, mc.head_dim)
    ctx = mp.get_context("spawn")
    pa, pb = ctx.Pipe()
    ca, cb = ctx.Pipe()
    procs = [ctx.Process(target=_worker, args=("p", pb, shape, ns.kv_dtype, ns.device, "bench-p")),
             ctx.Process(target=_worker, args=("c", cb, shape, ns.kv_dtype, ns.device, "bench-c"))]
    for p in procs:
        p.start()

    def recv(conn, timeout: float = 300.0):
        """The next message, or RuntimeError once a worker died or the timeout passed (never a hang)."""
        deadline = time.monotonic() + timeout
        while not conn.poll(0.5):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a transfer worker failed (exit codes {[p.exitcode for p in procs]})")
        return conn.recv()

    prod_meta, _ = recv(pa), recv(ca)
    ca.send(prod_meta)
    ca.send(list(ns.transfer_blocks))
    results = recv(ca)
    pa.send("done")
    for p in procs:
        p.join(30)
    return results


# ----------------------------------------------------------------------------- proxy
def _start(cmd: list[str], url: str, log) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy")


def _serve_cmd(ns, port: int, kv: dict | None) -> list[str]:
    exe = [sys.executable, "-m", "tallyserve.cli"]
    cmd = exe + ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--disable-access-log",
                 "--device", ns.device, "--block-size", str(ns.block_size)]
    if ns.model:
        cmd += ["--model", ns.model, "--load-format", ns.load_format]
    if ns.device.startswith("cuda"):
        cmd += ["--gpu-memory-utilization", str(ns.gpu_memory_utilization)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def _latencies(url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    out = []
    with httpx.Client(timeout=600) as c:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]
        for p in prompts:
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                      "temperature": 0.0, "ignore_eos": True})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rate_bench(url: str, trace: str, rate: float, out: str) -> dict:
    """`tallyserve bench` over a token-id trace at a Poisson request rate (streaming): TTFT / ITL."""
    from tallyserve.cli import main as cli_main

    cli_main(["bench", "--base-url", url, "--workload", f"file:{trace}", "--request-rate", str(rate),
              "--ignore-eos", "--disable-tqdm", "--output", out])
    r = json.loads(open(out).read())
    return {k: r[k] for k in ("completed", "errors", "duration_s", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
                              "p99_itl_ms", "output_throughput")}


def _write_trace(path: str, prompts: list[list[int]], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"r{i}", "prompt_token_ids": p, "max_tokens": max_tokens}) + "\n")


def bench_proxy(ns) -> dict:
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 20000) for _ in range(ns.prompt_len)] for _ in range(ns.requests)]
    ports = [_free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = open(os.path.join(ns.out_dir, "disagg_servers.log"), "w")  # the servers' output, for a failed start
    procs = []
    try:
        procs.append(_start(_serve_cmd(ns, ports[0], {"kv_role": "kv_producer", "engine_id": "bench-prefill"}),
                            urls[0], logs))
        procs.append(_start(_serve_cmd(ns, ports[1], {"kv_role": "kv_consumer", "engine_id": "bench-decode"}),
                            urls[1], logs))
        procs.append(_start([sys.executable, "-m", "tallyserve.cli", "proxy", "--port", str(ports[2]),
                             "--prefill", urls[0], "--decode", urls[1]], urls[2], logs))
        _latencies(urls[2], prompts[:2], ns.max_tokens)  # warm up (first handshake included here)
        disagg = _latencies(urls[2], [p[::-1] for p in prompts], ns.max_tokens)
        rated = {}
        if ns.request_rate:
            trace = os.path.join(ns.out_dir, "rate_trace.jsonl")
            _write_trace(trace, [[(t * 7 + 3) % 20000 + 10 for t in p] for p in prompts], ns.max_tokens)
            rated["disagg"] = _rate_bench(urls[2], trace, ns.request_rate, os.path.join(ns.out_dir, "rate_disagg.json"))
        lines = httpx.get(urls[1] + "/metrics").text.splitlines()
        stats = dict(line.split(" ", 1) for line in lines if line.startswith("tallyserve_kv_connector_"))
        for p in procs:
            p.terminate()
            p.wait(30)
        procs = [_start(_serve_cmd(ns, ports[3], None), urls[3], logs)]
        _latencies(urls[3], prompts[:2], ns.max_tokens)
        colocated = _latencies(urls[3], [p[::-1] for p in prompts], ns.max_tokens)
        if ns.request_rate:
            rated["colocated"] = _rate_bench(urls[3], trace, ns.request_rate,
                                             os.path.join(ns.out_dir, "rate_colocated.json"))
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    return {"requests": ns.requests, "prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens,
            "colocated_p50_s": _pct(colocated, 0.5), "colocated_p99_s": _pct(colocated, 0.99),
            "disagg_p50_s": _pct(disagg, 0.5), "disagg_p99_s": _pct(disagg, 0.99),
            "overhead_p50_ms": 1000 * (_pct(disagg, 0.5) - _pct(colocated, 0.5)),
            "overhead_mean_ms": 1000 * (statistics.mean(disagg) - statistics.mean(colocated)),
            "decode_kv_counters": stats, "request_rate": ns.request_rate, "at_rate": rated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["transfer", "proxy"], default=None)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="float32", help="KV dtype of the transfer test (bfloat16 on GPUs)")
    ap.add_argument("--transfer-blocks", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="proxy: also send the requests (other tokens) at this Poisson rate through `tallyserve bench`, "
                    "through the proxy and to the colocated instance: TTFT and ITL p50/p99")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "/tmp", help="where the rate traces and records go")
    ns = ap.parse_args()
    report = {}
    if ns.only in (None, "transfer"):
        report["transfer"] = bench_transfer(ns)
        for r in report["transfer"]:
            print(f"transfer {r['blocks']:4d} blocks {r['pattern']:10s} {r['bytes'] / 1e6:8.2f} MB  {r['seconds'] * 1e3:8.2f} ms  "
                  f"{r['GB_per_s']:6.2f} GB/s  {'ok' if r['ok'] else 'WRONG BYTES'}")
    if ns.only in (None, "proxy"):
        report["proxy"] = bench_proxy(ns)
        print(json.dumps(report["proxy"], indent=1))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
