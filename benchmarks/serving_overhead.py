#!/usr/bin/env python3
"""What the HTTP serving path costs over the offline engine, with the step loop in a thread of the
server and in the engine core process (--enable-frontend-multiprocessing):

    python3 benchmarks/serving_overhead.py                      # a tiny random model on the CPU
    python3 benchmarks/serving_overhead.py --model llama-3-8b --load-format dummy \\
        --tokenizer <dir> --device cuda                          # the H200 case

The same N requests of random token-id prompts (--input-len tokens, --output-len new tokens, greedy,
ignore_eos), all sent at once:
1. offline  `LLM.generate` (in a subprocess, so its memory is gone before the servers start),
2. thread   `tallyserve serve` (step loop in a thread) + `tallyserve bench` (streaming),
3. process  `tallyserve serve --enable-frontend-multiprocessing` + `tallyserve bench`.
Each after a short warm-up. Prints the three makespans and their ratios to offline; writes JSON to
--output (default $OUT/serving_overhead.json, or /tmp/serving_overhead/serving_overhead.json).
Without --model, a random Llama (2 layers, hidden 64, vocab 256, ChatML-free tokenizer) is written
under the output directory, so the run is host-bound like the H200 case.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("offline", "thread", "process")


def _engine_flags(args) -> list[str]:
    flags = ["--model", args.model, "--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
             "--max-num-seqs", str(max(args.num_requests, 1))]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    return flags + list(args.engine_arg)


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _write_trace(path: Path, prompts: list[list[int]], max_tokens: int) -> None:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"request_id": f"r-{i}", "prompt_token_ids": p, "max_tokens": max_tokens,
                                "arrival_s": 0.0}) + "\n")


def _vocab_size(args) -> int:
    from tallyserve.models.loader import resolve_model

    return resolve_model(args.model, args.load_format).model_config.vocab_size


def offline_worker(args) -> int:
    """Subprocess: warm up, then generate every prompt at once; print the makespan as JSON."""
    from tallyserve import LLM, SamplingParams
    from tallyserve.cli import build_parser

    ns = build_parser().parse_args(["serve", *_engine_flags(args)])
    from tallyserve.cli import engine_args_from

    llm = LLM(**{k: v for k, v in vars(engine_args_from(ns)).items()})
    trace = [json.loads(line) for line in Path(args.trace).read_text().splitlines()]
    warm = [json.loads(line) for line in Path(args.warm_trace).read_text().splitlines()]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": t["prompt_token_ids"]} for t in warm],
                 SamplingParams(max_tokens=warm[0]["max_tokens"], **greedy), use_tqdm=False)
    prompts = [{"prompt_token_ids": t["prompt_token_ids"]} for t in trace]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=trace[0]["max_tokens"], **greedy), use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"duration_s": wall, "completed": len(outs), "output_tokens": tokens}), flush=True)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def run_offline(args, out_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--offline-worker", "--trace", str(out_dir / "trace.jsonl"),
           "--warm-trace", str(out_dir / "warm.jsonl"), *_script_flags(args)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"offline run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def run_server(args, out_dir: Path, mode: str) -> dict:
    from tallyserve.cli import main as cli_main

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    flag = "--enable-frontend-multiprocessing" if mode == "process" else "--disable-frontend-multiprocessing"
    log = open(out_dir / f"server_{mode}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tallyserve.cli", "serve", *_engine_flags(args), "--port", str(port),
                             "--log-level", "warning", "--disable-access-log", flag],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    record = out_dir / f"bench_{mode}.json"
    try:
        _wait_healthy(url, proc, 900)
        cli_main(["bench", "--base-url", url, "--workload", f"file:{out_dir / 'warm.jsonl'}", "--ignore-eos",
                  "--disable-tqdm"])
        rc = cli_main(["bench", "--base-url", url, "--workload", f"file:{out_dir / 'trace.jsonl'}", "--ignore-eos",
                       "--disable-tqdm", "--output", str(record)])
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    bench = json.loads(record.read_text())
    return {"rc": rc, "duration_s": bench["duration_s"], "completed": bench["completed"], "errors": bench["errors"],
            "output_tokens": bench["total_output_tokens"], "ttft_p50_ms": bench.get("p50_ttft_ms"),
            "itl_p50_ms": bench.get("p50_itl_ms"), "itl_p99_ms": bench.get("p99_itl_ms")}


def _script_flags(args) -> list[str]:
    out = ["--model", args.model, "--load-format", args.load_format, "--device", args.device, "--dtype", args.dtype,
           "--num-requests", str(args.num_requests)]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    for e in args.engine_arg:
        out.append(f"--engine-arg={e}")
    return out


def _tiny_model(out_dir: Path) -> str:
    from tests.tiny_models import make_tiny_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = out_dir / "tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_model(path, "llama", seed=0, num_hidden_layers=2, hidden_size=64)
        make_tiny_tokenizer(str(path))
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama written to the output directory")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of offline,thread,process")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="an extra engine flag for all three runs, e.g. --engine-arg=--block-size=16")
    ap.add_argument("--output", default=None)
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-trace", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline_worker:
        return offline_worker(args)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        ap.error(f"--modes must be a subset of {','.join(MODES)}")
    output = Path(args.output) if args.output else Path(os.environ.get("OUT") or "/tmp/serving_overhead") / \
        "serving_overhead.json"
    out_dir = output.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = _tiny_model(out_dir)
    vocab = _vocab_size(args)
    _write_trace(out_dir / "trace.jsonl", _prompts(vocab, args.num_requests, args.input_len, 0), args.output_len)
    _write_trace(out_dir / "warm.jsonl", _prompts(vocab, 8, args.input_len, 1), 8)
    results: dict = {"model": args.model, "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "engine_args": args.engine_arg, "cpu_count": os.cpu_count()}
    for mode in modes:
        results[mode] = run_offline(args, out_dir) if mode == "offline" else run_server(args, out_dir, mode)
        print(f"{mode:8s} makespan {results[mode]['duration_s']:.3f} s", flush=True)
    if "offline" in results:
        base = results["offline"]["duration_s"]
        for mode in ("thread", "process"):
            if mode in results:
                results[mode]["over_offline"] = round(results[mode]["duration_s"] / base, 4)
                print(f"{mode:8s} / offline = {results[mode]['over_offline']:.3f}", flush=True)
    if "thread" in results and "process" in results:
        results["process_over_thread"] = round(results["process"]["duration_s"] / results["thread"]["duration_s"], 4)
        print(f"process / thread = {results['process_over_thread']:.3f}", flush=True)
    output.write_text(json.dumps(results, indent=2))
    print(f"wrote {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
