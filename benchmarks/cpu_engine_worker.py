"""One offline run of workload W on one engine, in its own process (and, for vLLM, its own virtualenv).

    python cpu_engine_worker.py ENGINE --prompts prompts.json --out result.json --threads 2 [--model-dir DIR]

ENGINE is tallyserve, transformers or vllm (float32), or tallyserve-bf16 or vllm-bf16. The prompts file holds W's
token id lists; the result file gets
``{"engine", "time_s", "load_s", "outputs", "version", "threads", "settings"}``. Every engine first answers two short
warm-up prompts; only the timed call that submits all of W at once (greedy, EOS ignored) counts. This file
imports nothing from the repo: it also runs in vLLM's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _warmup_prompts(prompts):
    """Two 32-token prompts of ids W never draws (W's are below 40,000), so no prefix cache carries over."""
    return [[40000 + (37 * j + k) % 9000 for k in range(32)] for j in range(2)]


def run_tallyserve(prompts, max_tokens, threads, model_dir, dtype="auto"):
    import torch

    torch.set_num_threads(threads)
    import tallyserve
    from tallyserve import LLM, SamplingParams

    t0 = time.perf_counter()
    # the bundled model, fp32 on the CPU (or dtype="bfloat16": bf16 projections), every other setting at its default
    llm = LLM(dtype=dtype)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _warmup_prompts(prompts)], warm)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t = time.perf_counter()
    outs = llm.generate(batch, sp)
    elapsed = time.perf_counter() - t
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    settings = {"dtype": "float32 (default)" if dtype == "auto" else dtype}
    return elapsed, load_s, outputs, getattr(tallyserve, "__version__", "repo"), settings


def run_transformers(prompts, max_tokens, threads, model_dir):
    import torch

    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    # eos_token_id=None: continuous batching then disables EOS (ignore_eos).
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
    # On the CPU the KV cache cannot be sized from GPU memory: size it for W (64 x (512 + 64) tokens, 1/8 spare).
    page = 64
    per_request = -(-(max(len(p) for p in prompts) + max_tokens) // page)
    num_blocks = len(prompts) * per_request * 9 // 8 + 1
    settings = {"dtype": "float32", "page_size": page, "num_blocks": num_blocks, "max_batch_tokens": 2048,
                "attn_implementation": model.config._attn_implementation}
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=2048)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    model.generate_batch(_warmup_prompts(prompts), generation_config=warm, continuous_batching_config=cb,
                         warmup=False)
    t = time.perf_counter()
    res = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    elapsed = time.perf_counter() - t
    if len(res) != len(prompts):
        raise RuntimeError(f"transformers answered {len(res)} of {len(prompts)} requests")
    failed = [k for k, r in res.items() if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers failed {len(failed)} requests, first {failed[0]}: {res[failed[0]].error}")
    outputs = [list(r.generated_tokens) for r in res.values()]  # generate_batch returns them in input order
    return elapsed, load_s, outputs, transformers.__version__, settings


def run_vllm(prompts, max_tokens, threads, model_dir, dtype="float32"):
    # Set by the driver before this process started: VLLM_CPU_OMP_THREADS_BIND (0-1 for 2 threads, 0 for 1).
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    util = float(os.environ.get("CPUBENCH_VLLM_MEMORY_UTILIZATION", "0.3"))
    max_len = max(len(p) for p in prompts) + max_tokens
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, gpu_memory_utilization=util, max_model_len=max(max_len, 1024),
              seed=0)
    load_s = time.perf_counter() - t0
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in _warmup_prompts(prompts)], warm, use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    settings = {"dtype": dtype, "gpu_memory_utilization": util,
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "max_model_len": max(max_len, 1024), "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    return elapsed, load_s, outputs, vllm.__version__, settings


RUNNERS = {"tallyserve": run_tallyserve, "transformers": run_transformers, "vllm": run_vllm,
           # bfloat16: tallyserve's bf16 projections in a float32 model; vLLM's whole model (and KV cache) in bf16
           "tallyserve-bf16": lambda *a: run_tallyserve(*a, dtype="bfloat16"),
           "vllm-bf16": lambda *a: run_vllm(*a, dtype="bfloat16")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=sorted(RUNNERS))
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    elapsed, load_s, outputs, version, settings = RUNNERS[args.engine](prompts, args.max_tokens, args.threads,
                                                                      args.model_dir)
    result = {"engine": args.engine, "time_s": elapsed, "load_s": load_s, "outputs": outputs, "version": version,
              "threads": args.threads, "settings": settings,
              "output_tokens": sum(len(o) for o in outputs)}
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    print(f"[{args.engine}] W: {elapsed:.3f} s ({result['output_tokens']} output tokens), load {load_s:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
