"""Workload W in this process, phase by phase: the bundled model through ``LLM`` (prefix caching off, so repeated
runs recompute the prompts), one run per ``--max-tokens`` value in order, each printed with its wall time and a
hash of its output token ids (the same hash means the same greedy tokens).

    python benchmarks/cpu_w_inprocess.py --dtype bfloat16 --max-tokens 1 64     # prompts alone, then all of W
    TALLYSERVE_CPU_ONEDNN_FP32=0 python benchmarks/cpu_w_inprocess.py --dtype float32 --max-tokens 64
    python3 -c "while True: pass" & python benchmarks/cpu_w_inprocess.py --max-tokens 64; kill %1   # beside a busy loop

``--log-threads`` prints each change of the CPU thread governor with its time (TALLYSERVE_CPU_THREADS pins it);
``--vector-width 16|8|0`` runs the attention kernel's AVX-512, AVX2 or generic path (default: the widest built)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu_workload import NUM_PROMPTS, SEED, make_workload  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--log-threads", action="store_true")
    ap.add_argument("--vector-width", type=int, choices=[16, 8, 0], default=None)
    args = ap.parse_args(argv)
    if min(args.max_tokens) < 1 or args.threads < 1 or args.num_prompts < 1:
        ap.error("--max-tokens, --threads and --num-prompts must be positive")
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
        from tallyserve.attention import cpu_kernels
        if not cpu_kernels.load() or torch.ops.tallyserve_cpu.set_vector_width(args.vector_width) != args.vector_width:
            ap.error(f"this build has no {args.vector_width}-lane attention path")
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.num_prompts, SEED)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for mt in args.max_tokens:
        t0 = time.monotonic()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True))
        elapsed = time.monotonic() - t0
        digest = hash(tuple(tuple(o.outputs[0].token_ids) for o in outs))
        print(f"W {args.dtype} max_tokens={mt}: {elapsed:.2f} s  tokens hash {digest}", flush=True)
        for t, n in changes:
            if t >= t0:
                print(f"  threads -> {n} at +{t - t0:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
