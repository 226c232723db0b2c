"""The CPU attention kernel's AMX path for chunks against its float32 vector path, the kernel alone.

The bundled model's attention shapes (9 query heads, 3 KV heads, head_dim 64), a bfloat16 cache (the
``dtype="bfloat16"`` mode; ``--kv-dtype float32`` shows that the AMX path leaves a float32 cache alone), blocks of 16:
  * one prompt of each ``--lengths`` tokens, all its rows in one call (nanoseconds per query-key score);
  * W's prompt lengths (``cpu_workload.py``: 64 prompts of 32-512 tokens), every prompt in one call per layer, for
    ``--layers`` layers with a cache each.
The two paths alternate in one process (``torch.ops.tallyserve_cpu.set_amx``) over ``--rounds`` rounds; the best
time of each counts. Needs a CPU with AMX-BF16 (Sapphire Rapids or later); elsewhere it says so and exits.

    python benchmarks/cpu_amx_attention.py --threads 1 --lengths 256 512 1024
    python benchmarks/cpu_amx_attention.py --threads 2 --w
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tallyserve.attention import cpu_kernels  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def _case(lengths: list[int], layers: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BS) for n in lengths]
    caches = [torch.randn(2, sum(blocks) + 1, BS, HKV, D, generator=gen).to(dtype) for _ in range(layers)]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    nxt = 0
    for r, nb in enumerate(blocks):  # each prompt's blocks in one run, as a prefill allocates them
        table[r, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
    q = torch.randn(sum(lengths), HQ, D, generator=gen)
    qsl = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
    return q, caches, table, qsl, torch.tensor(lengths, dtype=torch.long)


def _best(fn, rounds: int) -> dict[bool, float]:
    ops = torch.ops.tallyserve_cpu
    best = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for amx in (False, True):
            ops.set_amx(amx)
            fn()  # warm
            t0 = time.perf_counter()
            fn()
            best[amx] = min(best[amx], time.perf_counter() - t0)
    ops.set_amx(True)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024])
    ap.add_argument("--w", action="store_true", help="also W's 64 prompt lengths over --layers layers")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not cpu_kernels.load() or not torch.ops.tallyserve_cpu.amx_usable():
        print("no AMX path here (no AMX-BF16, or the CPU kernels could not be built): nothing to compare")
        return 0
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.kv_dtype)
    op = torch.ops.tallyserve_cpu.paged_attention
    rows = []
    for n in args.lengths:
        q, caches, table, qsl, lens = _case([n], 1, dtype)
        reps = max(1, 4_000_000 // (n * n))
        best = _best(lambda: [op(q, caches[0], table, qsl, lens, D ** -0.5) for _ in range(reps)], args.rounds)
        scores = n * (n + 1) / 2 * HQ * reps
        row = {"case": f"one prompt of {n}", "vector_ns_per_score": best[False] / scores * 1e9,
               "amx_ns_per_score": best[True] / scores * 1e9}
        rows.append(row)
        print(f"{row['case']:>22s}: vector {row['vector_ns_per_score']:.2f} ns/score, amx "
              f"{row['amx_ns_per_score']:.2f} ns/score ({best[False] / best[True]:.2f}x)")
    if args.w:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_workload import make_workload

        lengths = [len(p) for p in make_workload()]
        q, caches, table, qsl, lens = _case(lengths, args.layers, dtype)
        best = _best(lambda: [op(q, c, table, qsl, lens, D ** -0.5) for c in caches], args.rounds)
        rows.append({"case": f"W's {len(lengths)} prompts x {args.layers} layers", "vector_s": best[False],
                     "amx_s": best[True]})
        print(f"W's {len(lengths)} prompts x {args.layers} layers: vector {best[False]:.3f} s, amx {best[True]:.3f} s "
              f"({best[False] / best[True]:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "kv_dtype": args.kv_dtype, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
