"""Tensor-parallel worker overhead on the CPU (gloo): the same greedy workload at TP=1 (in process)
and TP=N (one worker process per rank), tokens/s and milliseconds per step.

Two models: a tiny random Llama (compute is negligible, so the difference per step is the cost of
the multi-process path: pickling the SchedulerOutput, the pipe, the gloo broadcast, the all-reduces
and the logits gather), and the bundled SmolLM2-135M (9 heads: TP=3 is its smallest split).

    PYTHONPATH=$PWD python3 benchmarks/cpu_tp_overhead.py [--bundled-tp 3] [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tallyserve import LLM, SamplingParams  # noqa: E402


def run(model: str, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    llm = LLM(model=model, tensor_parallel_size=tp, async_scheduling=False, kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    after = llm.stats()
    steps = after["steps"] - before["steps"]
    tokens = after["scheduled_tokens"] - before["scheduled_tokens"]
    result = {"model": model, "tp": tp, "wall_s": round(wall, 3), "steps": steps, "ms_per_step": round(1e3 * wall / steps, 2),
              "tokens_per_s": round(tokens / wall, 1), "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "token_ids": [o.outputs[0].token_ids for o in outs]}
    llm.engine.shutdown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny-tp", type=int, default=2)
    ap.add_argument("--bundled-tp", type=int, default=3)
    args = ap.parse_args()
    from tests.tiny_models import make_tiny_model

    tiny = make_tiny_model(tempfile.mkdtemp(), "llama", seed=0)
    rng = random.Random(0)
    rows = []
    for model, tp, vocab in ((tiny, args.tiny_tp, 256), (None, args.bundled_tp, 49152)):
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        base = run(model, 1, prompts, args.max_tokens)
        split = run(model, tp, prompts, args.max_tokens)
        same = base.pop("token_ids") == split.pop("token_ids")
        rows.append({"tp1": base, f"tp{tp}": split, "same_tokens": same,
                     "overhead_ms_per_step": round(split["ms_per_step"] - base["ms_per_step"], 2),
                     "speed_ratio": round(split["tokens_per_s"] / base["tokens_per_s"], 3)})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
