"""Prompt time on the CPU with the attention kernel's flash path for chunks against PyTorch's fused SDPA.

The bundled model in one process; for each case the two settings run in interleaved rounds (the SDPA side sets
``cpu_sdpa.FAST_ROWS_MAX_KEYS = 0``, which sends every chunk of more than 16 rows to the SDPA paths):
  * W's prompts (``cpu_workload.py``: 64 prompts of 32-512 random token ids), ``max_tokens=1``, prefix caching off;
  * one prompt of each ``--lengths`` tokens, ``max_tokens=1`` (time to first token offline).
Prints seconds per round and the min of each setting; ``--json`` writes them.

    python benchmarks/cpu_chunk_attention.py --dtype bfloat16 --rounds 3 --lengths 1030 2048 4000
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tallyserve import LLM, SamplingParams
from tallyserve.attention import cpu_sdpa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1030, 2048, 4000])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from cpu_workload import make_workload  # benchmarks/ is the script's directory

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(1)
    cases = {"W prompts": [{"prompt_token_ids": ids} for ids in make_workload()]}
    for n in args.lengths:
        cases[f"one prompt of {n}"] = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}]
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)  # warm-up: kernels built, pools made
    default = cpu_sdpa.FAST_ROWS_MAX_KEYS
    results: dict[str, dict[str, list[float]]] = {}
    for name, prompts in cases.items():
        times = results.setdefault(name, {"flash path": [], "sdpa": []})
        for r in range(args.rounds):
            for setting in (("flash path", "sdpa") if r % 2 == 0 else ("sdpa", "flash path")):
                cpu_sdpa.FAST_ROWS_MAX_KEYS = default if setting == "flash path" else 0
                start = time.perf_counter()
                llm.generate(prompts, params)
                times[setting].append(time.perf_counter() - start)
                print(f"{name:22s} round {r}  {setting:10s} {times[setting][-1]:.3f} s", flush=True)
        cpu_sdpa.FAST_ROWS_MAX_KEYS = default
        best = {k: min(v) for k, v in times.items()}
        print(f"{name:22s} min: flash path {best['flash path']:.3f} s, sdpa {best['sdpa']:.3f} s, "
              f"ratio {best['flash path'] / best['sdpa']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "rounds": args.rounds, "fast_rows_max_keys": default, "seconds": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
